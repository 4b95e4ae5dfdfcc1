"""`--io kvikio`: KvikIO reads the disk tier's image file straight into GPU memory, through
GPUDirect Storage where the system has it, or KvikIO's compat mode (POSIX reads through its own
pinned bounce buffers) where it does not. KvikIO is optional and not a dependency."""

from __future__ import annotations

from ..errors import MissingDependency

INSTALL_HINT = ("pip install kvikio-cu12 (CUDA 12) or kvikio-cu13 (CUDA 13), or use --io direct "
                "(O_DIRECT reads, the default)")


def require_kvikio():
    """The kvikio module, or a MissingDependency error that says how to install it."""
    try:
        import kvikio  # local: optional, not a dependency
    # not only ImportError: the package imports but its libraries fail to load (libcufile not
    # found, say), which the user fixes the same way
    except Exception as e:
        raise MissingDependency(f"--io kvikio needs the kvikio package, which does not import "
                                f"here ({e}): {INSTALL_HINT}") from None
    return kvikio


def gds_enabled() -> bool:
    """Whether KvikIO will use GPUDirect Storage (the API moved between releases; the answer
    only goes into the note, so any failure reads as compat mode)."""
    try:
        import kvikio.defaults as d  # optional; a submodule the package does not import

        if hasattr(d, "is_compat_mode_preferred"):
            return not d.is_compat_mode_preferred()
        return not bool(d.compat_mode())
    except Exception:
        return False


def bypass_page_cache() -> None:
    """Tier C reads bypass the page cache, KvikIO's too: in compat mode it would otherwise read
    through it, and a RAM large enough to cache the file would stand in for the disk. Set for
    the process (the reads run later, on KvikIO's threads); KvikIO releases without the
    setting read as they always did."""
    try:
        import kvikio.defaults as d  # local: optional, not a dependency

        d.set("auto_direct_io_read", True)
    except Exception:  # a release without the setting (or without defaults.set)
        pass
