"""The tools' one way to write an output file: beside its place, flushed to disk, then renamed
over it, so a full disk or a kill leaves the old file (or none), never a truncated one.

    from write_whole import write_whole   # a script in tools/ finds its siblings
"""
import os


def write_whole(path, data):
    """path <- data (str or bytes), replaced only once the whole new content is on disk. An
    OSError propagates for the caller to name, its partial file removed."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
