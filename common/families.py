"""The model families Prism serves, and what each service must know of them.

A checkpoint's `model_type` picks its family. A family's `layout` says how
its images become tokens:
- "qwen" (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the image is resized to a pixel
  budget with sides a multiple of patch × merge (gateway/intake/resize.py), and its
  tokens form a (t, h, w) grid that vLLM takes beside the embeddings;
- "anyres" (LLaVA-OneVision, LLaVA-NeXT): tiles of the image at its best grid pinpoint
  plus a base tile, one token list per image with newline tokens in it
  (common/anyres.py); vLLM takes the list alone;
- "tiles" (InternVL3): square tiles of the image stretched onto the grid
  closest to its aspect ratio, plus a thumbnail (common/tiles.py); a list, too;
- "text": a language model with no vision part (any checkpoint without a
  `vision_config`, of an architecture vLLM serves). It is served with no
  encoder, and a request with an image gets a 400 naming the model.
The gateway learns the layout's numbers from the encoder's handshake; the
encoder picks its tower by layout (vision_encoder/towers/); the engine
needs the width of the embeddings it hands vLLM, and whether vLLM must keep
the checkpoint's vision tower loaded to take them.

No torch here: the gateway and the launcher import this module too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


# The vision parts of a checkpoint by layout, under the language model's `model.` where it has one
# (Qwen's are named in `is_vision_weight`).
_VISION_PARTS = {
    "anyres": ("vision_tower.", "multi_modal_projector.", "image_newline"),
    "tiles": ("vision_tower.", "multi_modal_projector."),
}


class UnsupportedModel(ValueError):
    """The checkpoint is of a family Prism cannot serve; the message says why."""


@dataclass(frozen=True)
class Family:
    name: str
    # model_type → the transformers class that holds the vision code, "module:Class"
    towers: dict[str, str]
    layout: str = "qwen"  # "qwen" | "anyres" | "tiles" | "text", see above
    # Qwen3-VL: the encoder's output is the merger's tokens followed, along the
    # hidden axis, by the DeepStack feature of each `deepstack_visual_indexes`
    # layer (vLLM splits them again and adds them into the first LLM layers).
    deepstack: bool = False
    # vLLM's tool-call parser for the family's chat format (engine.tool_call_parser "auto").
    # Qwen2-VL, Qwen2.5-VL and Qwen3-VL all call tools as <tool_call>{json}</tool_call>.
    tool_call_parser: str | None = "hermes"

    @property
    def takes_images(self) -> bool:
        return self.layout != "text"

    def is_vision_weight(self, name: str) -> bool:
        """A checkpoint tensor of the vision tower and its projection into the LLM: what the encoder's
        tower loads (its `vision_weight`), and what an encoder and an engine must share (common/checkpoint.py)."""
        if self.layout == "qwen":
            return name.startswith(("model.visual.", "visual."))
        return name.removeprefix("model.").startswith(_VISION_PARTS.get(self.layout, ()))

    def embedding_width(self, hf_config: Any) -> int:
        """Columns of one image's embeddings as vLLM takes them."""
        hidden = hf_config.text_config.hidden_size
        if self.deepstack:
            return hidden * (1 + len(hf_config.vision_config.deepstack_visual_indexes))
        return hidden

    @property
    def vllm_needs_tower(self) -> bool:
        """vLLM 0.32 drops Qwen3-VL's DeepStack path when its vision tower is not
        loaded (`use_deepstack` is False once every image limit is 0), and then
        cannot take the wider embeddings: such a family keeps vLLM's tower
        (weights only: raw images never reach vLLM)."""
        return self.deepstack


_QWEN2 = "transformers.models.qwen2_vl.modeling_qwen2_vl"
_QWEN2_5 = "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"
_QWEN3 = "transformers.models.qwen3_vl.modeling_qwen3_vl"
_QWEN3_MOE = "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe"
_ONEVISION = "transformers.models.llava_onevision.modeling_llava_onevision"
_NEXT = "transformers.models.llava_next.modeling_llava_next"
_INTERNVL = "transformers.models.internvl.modeling_internvl"

FAMILIES = (
    Family("Qwen2-VL", {"qwen2_vl": f"{_QWEN2}:Qwen2VisionTransformerPretrainedModel"}),
    Family("Qwen2.5-VL", {"qwen2_5_vl": f"{_QWEN2_5}:Qwen2_5_VisionTransformerPretrainedModel"}),
    Family("Qwen3-VL", {"qwen3_vl": f"{_QWEN3}:Qwen3VLVisionModel", "qwen3_vl_moe": f"{_QWEN3_MOE}:Qwen3VLMoeVisionModel"},
           deepstack=True),
    Family("LLaVA-OneVision", {"llava_onevision": f"{_ONEVISION}:LlavaOnevisionModel"}, layout="anyres"),
    # LLaVA-NeXT's language models (Mistral, Vicuna, Llama 3, Qwen) have no one tool-call format.
    Family("LLaVA-NeXT", {"llava_next": f"{_NEXT}:LlavaNextModel"}, layout="anyres", tool_call_parser=None),
    # The Hugging Face format (OpenGVLab/InternVL3-*-hf); InternVL3's language models are Qwen2.5's.
    Family("InternVL3", {"internvl": f"{_INTERNVL}:InternVLModel"}, layout="tiles"),
)

# Any language model without a vision part; vLLM judges its architecture.
TEXT_ONLY = Family("text-only", {}, layout="text", tool_call_parser=None)

# Families vLLM 0.32 serves only from raw images: it takes no precomputed
# image embeddings for them (read from vLLM's model files), and Prism's engine
# receives images only as embeddings.
NO_EMBEDDINGS_IN_VLLM = {
    "gemma3": "Gemma 3",
    "mistral3": "Mistral 3 / Pixtral",
    "pixtral": "Pixtral",
    "idefics3": "Idefics3",
    "smolvlm": "SmolVLM",
}


# Models whose conversations vLLM's server renders and parses in a format of their own, not through
# the checkpoint's chat template and vLLM's tool and reasoning parsers, as Prism's engine does.
OWN_CONVERSATION_FORMAT = {"gpt_oss": "gpt-oss speaks OpenAI's Harmony format"}


def supported() -> str:
    return ", ".join(f"{f.name} ({', '.join(f.towers)})" for f in FAMILIES)


def family_of(hf_config: Any) -> Family:
    """The checkpoint's family, or UnsupportedModel naming its architecture and why."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in OWN_CONVERSATION_FORMAT:
        raise UnsupportedModel(
            f"{OWN_CONVERSATION_FORMAT[model_type]}, which vLLM's server renders and parses with code of its own: Prism's "
            f"engine renders the chat template and parses with vLLM's tool and reasoning parsers, so its answers would not "
            f"be vLLM's (its reasoning would not even come apart). Serve it with vLLM's own server; Prism serves {supported()} "
            f"and language models without a vision part that use a chat template"
        )
    if getattr(hf_config, "vision_config", None) is None and model_type not in NO_EMBEDDINGS_IN_VLLM:
        return TEXT_ONLY
    for family in FAMILIES:
        if model_type in family.towers:
            return family
    architecture = (getattr(hf_config, "architectures", None) or [model_type])[0]
    if model_type in NO_EMBEDDINGS_IN_VLLM:
        raise UnsupportedModel(
            f"{NO_EMBEDDINGS_IN_VLLM[model_type]} ({architecture}) cannot be served by Prism: vLLM 0.32 takes no "
            f"precomputed image embeddings for this family, and Prism's engine receives images only as embeddings "
            f"from its vision encoder. Supported families: {supported()}"
        )
    raise UnsupportedModel(f"unsupported architecture {architecture} (model_type {model_type!r}); supported families: {supported()}")
