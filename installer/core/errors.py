"""User-facing installer errors: each message names the problem and the fix; no traceback."""


class InstallerError(Exception):
    """A problem the user can act on; printed as one message, never as a traceback."""


class SettingsError(InstallerError):
    """An environment variable holds a value that is not accepted."""


class FetchError(InstallerError):
    """A release asset or manifest could not be downloaded (network, HTTP status, offline)."""


class VerificationError(InstallerError):
    """A downloaded asset does not match the checksum of the release manifest."""
