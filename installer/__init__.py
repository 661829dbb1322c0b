"""Build-time machinery of cudelta: detect the target, choose/fetch/verify a prebuilt wheel, else build.

Shipped in the sdist, never installed: setup.py imports it from the source tree.
"""
