"""vLLM 0.32's LLaVA-NeXT and LLaVA-OneVision take precomputed image embeddings
of any length per image (`_process_image_input` returns them as they come),
but their input schemas declare one length for every image in a batch. Two
requests whose images differ in size, scheduled into the same step, then fail
the schema check in the worker, and the engine core dies with them (the same
bug as vLLM issue #39681 for Gemma 4's pixels). Every LLaVA-OneVision image
of another size has another length, so without this a second concurrent user
takes the engine down.

Installed by this directory's `sitecustomize` in every process vLLM spawns:
once vLLM imports one of these model modules, its embedding length is marked
dynamic, which is what the schemas' own docstrings say it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import typing

# module → (schema class, field, the dimension whose size varies per image)
FIXES = {
    "vllm.model_executor.models.llava_onevision": ("LlavaOnevisionImageEmbeddingInputs", "data", "ifs"),
    "vllm.model_executor.models.llava_next": ("LlavaNextImageEmbeddingInputs", "data", "ifs"),
    "vllm.model_executor.models.interns1": ("InternS1ImageEmbeddingInputs", "data", "tifs"),  # InternVL's
}


def mark_dynamic(module, schema: str, field: str, dim: str) -> None:
    hint = typing.get_type_hints(getattr(module, schema), include_extras=True)[field]
    shapes = [meta for meta in getattr(hint, "__metadata__", ()) if hasattr(meta, "dynamic_dims")]
    if not shapes or dim not in shapes[0].dims:
        raise RuntimeError(f"{module.__name__}.{schema}.{field} has no dimension {dim!r}: update {__name__}")
    shapes[0].dynamic_dims.add(dim)


class _FixOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in FIXES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def run_and_fix(module) -> None:
            run_module(module)
            mark_dynamic(module, *FIXES[name])

        spec.loader.exec_module = run_and_fix  # this spec's own loader instance
        return spec


def install() -> None:
    for name in FIXES:
        if name in sys.modules:  # imported already: fix it in place
            mark_dynamic(sys.modules[name], *FIXES[name])
    if not any(isinstance(finder, _FixOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FixOnImport())
