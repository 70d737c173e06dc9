"""The programs the wheel installs as scripts (``ss_shm_manager``,
``ssctl``): pip puts them in the environment's scripts folder (``bin/`` of a
virtual environment, ``~/.local/bin`` for ``--user``), which need not be on
PATH, so the package finds them through its own install record."""

import os
from importlib import metadata
from pathlib import Path
from typing import Optional

_DISTRIBUTION = "storage-sharing"


def installed_script(name: str) -> Optional[Path]:
    """The executable ``name`` installed with this very copy of the package,
    or None (a build without scripts, such as ``pip install ./python``)."""
    try:
        dist = metadata.distribution(_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    # Another install of the package earlier on sys.path is not ours: its
    # scripts may be of another version.
    here = Path(__file__).resolve().parent
    if Path(str(dist.locate_file("storage_sharing"))).resolve() != here:
        return None
    for entry in dist.files or ():
        if entry.name != name or entry.parent.name != "bin":
            continue
        path = Path(str(dist.locate_file(entry))).resolve()
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None
