"""The images: built as docker-compose builds them, and built again from a copy
of the tree with one line of source changed, the way a developer's next build
goes (the dependency layer must come from the cache)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from common.config import REPO_ROOT
from tests.containers.compose import Compose
from tests.containers.daemon import docker
from tests.integration.system import binary

IMAGE = "prism:cpu"  # docker-compose.yml's
REBUILT = "prism-rebuilt:cpu"
CHANGED = "gateway/__init__.py"


def timed(action) -> float:
    started = time.monotonic()
    action()
    return time.monotonic() - started


def build(compose: Compose) -> dict[str, float]:
    """Seconds to build the Prism image, then the Debian stand-ins (and the
    other Prism services, which share the image: from the cache)."""
    return {"prism_image_s": timed(lambda: compose("build", "gateway")), "others_s": timed(lambda: compose("build"))}


def rebuild_after_a_one_line_change(base: str, workdir: Path) -> float:
    tree = copy_of_the_tree(workdir / "tree")
    with (tree / CHANGED).open("a") as source:
        source.write("# one line changed by tests/containers\n")
    return timed(lambda: docker("build", "-q", "-f", "docker/Dockerfile", "--build-arg", f"BASE_IMAGE={base}",
                                "--build-arg", "FLAVOUR=cpu", "-t", REBUILT, str(tree), timeout_s=1800))


def copy_of_the_tree(to: Path) -> Path:
    """The files `docker build .` would see here: tracked and untracked but not ignored."""
    listed = subprocess.run([binary("git"), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO_ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_symlink() or source.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name, follow_symlinks=False)
    return to
