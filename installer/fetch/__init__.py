"""A prebuilt wheel: URL policy (urls), pip's network settings (network), the bounded, retried
download (transfer, fetch), the locked cache (cache), sha256 and size (verify), and
prebuilt.install_prebuilt, from the trusted manifest to the retagged wheel. Imports core and choose.
"""
