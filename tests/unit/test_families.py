"""Which checkpoints Prism serves, and what it says of the others."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, Gemma3Config, LlamaConfig, PaliGemmaConfig, Qwen2VLConfig, Qwen3VLConfig

from common.families import TEXT_ONLY, UnsupportedModel, family_of


def test_the_qwen_families_are_recognised_and_qwen3_embeddings_carry_the_deepstack_layers():
    qwen3 = Qwen3VLConfig(text_config={"hidden_size": 256}, vision_config={"deepstack_visual_indexes": [8, 16, 24]})
    assert family_of(qwen3).name == "Qwen3-VL" and family_of(qwen3).embedding_width(qwen3) == 256 * 4
    qwen2 = Qwen2VLConfig(text_config={"hidden_size": 128})
    assert family_of(qwen2).name == "Qwen2-VL" and family_of(qwen2).embedding_width(qwen2) == 128
    assert family_of(AutoConfig.for_model("qwen3_vl_moe")).name == "Qwen3-VL"


def test_a_family_vllm_takes_no_embeddings_for_is_refused_with_the_reason():
    with pytest.raises(UnsupportedModel, match=r"Gemma 3 \(Gemma3ForConditionalGeneration\).*no precomputed image embeddings.*Qwen2-VL"):
        family_of(Gemma3Config(architectures=["Gemma3ForConditionalGeneration"]))


def test_an_unknown_vision_architecture_is_refused_naming_it_and_the_supported_families():
    with pytest.raises(UnsupportedModel, match=r"unsupported architecture PaliGemmaForConditionalGeneration .*'paligemma'.*Qwen2-VL.*Qwen3-VL.*LLaVA-OneVision.*LLaVA-NeXT.*InternVL3"):
        family_of(PaliGemmaConfig(architectures=["PaliGemmaForConditionalGeneration"]))


def test_a_language_model_without_a_vision_part_is_served_text_only():
    family = family_of(LlamaConfig(architectures=["LlamaForCausalLM"]))
    assert family is TEXT_ONLY and not family.takes_images
    assert all(f.takes_images for f in (family_of(Qwen2VLConfig()), family_of(AutoConfig.for_model("llava_onevision"))))


def test_a_model_vllm_talks_to_in_a_format_of_its_own_is_refused_naming_it():
    with pytest.raises(UnsupportedModel, match=r"gpt-oss speaks OpenAI's Harmony format.*Serve it with vLLM's own server"):
        family_of(AutoConfig.for_model("gpt_oss"))


def test_the_real_width_profile_has_qwen2_5_vl_7b_widths_and_a_two_core_depth():
    from prism.demo_model import SEED, build_tokenizer
    from prism.tiny_models import qwen2_5_vl_7b_widths_config

    config = qwen2_5_vl_7b_widths_config(build_tokenizer(SEED))
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_attention_heads, text.num_key_value_heads) == (3584, 18944, 28, 4)
    assert text.num_hidden_layers == 1 and text.hidden_size // text.num_attention_heads == 128  # a head size vLLM's CPU backend takes
    assert sum(text.rope_scaling["mrope_section"]) == 128 // 2
    assert (vision.hidden_size, vision.intermediate_size, vision.num_heads, vision.out_hidden_size) == (1280, 3420, 16, 3584)
    assert vision.depth == 2 and vision.fullatt_block_indexes == [1]
    assert family_of(config).embedding_width(config) == 3584
