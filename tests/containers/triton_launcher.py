"""Run inside an image: Triton's NVIDIA driver source compiled by Triton's own
build function, as the image's user, the step every CUDA kernel's first
launch takes (its launcher is C compiled the same way). Without `-lcuda`: no
driver to link against on a machine without a GPU. Prints the library built."""

import os
import tempfile
from pathlib import Path

from triton.backends.nvidia import driver
from triton.runtime.build import _build

if __name__ == "__main__":
    sources = Path(driver.__file__).parent
    with tempfile.TemporaryDirectory() as work:
        source = Path(work) / "cuda_utils.c"
        source.write_text((sources / "driver.c").read_text())
        built = _build("cuda_utils", str(source), work, [], [str(sources / "include")], [], [])
        print(os.path.basename(built))
