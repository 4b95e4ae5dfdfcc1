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
        import kvikio
    # not only ImportError: the package imports but its libraries fail to load (libcufile not
    # found, say), which the user fixes the same way
    except Exception as e:
        raise MissingDependency(f"--io kvikio needs the kvikio package, which does not import "
                                f"here ({e}): {INSTALL_HINT}") from None
    return kvikio
