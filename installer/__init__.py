"""Build-time machinery of cudelta: detect the target, choose/fetch/verify a prebuilt wheel, else build.

Shipped in the sdist, never installed: setup.py imports it from the source tree. Its wings, each
importing only its own modules and those of a lower layer (tests/unit/test_installer_layers.py):

    core                 shared by all
    detect, choose       the target's facts; what to install (neither imports the other)
    fetch, compile       a verified prebuilt wheel; a local compile (neither imports the other)
    commands, dead_end   the setuptools commands and the last line of an install that cannot succeed
"""
