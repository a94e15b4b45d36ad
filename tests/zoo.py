"""A zoo of tiny transformers models, one per causal-LM family registered in the installed ``transformers``
(tests/test_zoo.py trains each under the pipeline).

Every family's config is shrunk generically: the config class's dataclass fields are read, and whichever size
fields it declares (hidden width, depth, heads, key/value heads, head dim, feed-forward width, vocabulary,
positions, experts, state-space sizes, ...) are overridden to tiny values; every dropout is set to 0 and the KV cache
is turned off. Sub-configs (``text_config``, ``vision_config``, ...) are shrunk the same way, recursively. A handful of
families need a per-family fix on top of that (``_FAMILY_FIXES``, each with its reason). The families left out of
the zoo -- no plain ``input_ids -> loss`` step, float64 unsupported, or multimodal towers that such a step never
reaches -- are listed in ``SKIP`` with theirs.

Nothing is downloaded: every model is built from a config with ``from_config``, weights initialised from a seed.

Typical use::

    for model_type in causal_lm_families():
        if model_type in SKIP:
            continue
        model = build(model_type)
        ids = torch.randint(0, 64, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = ["SKIP", "build", "causal_lm_families", "tiny_config", "tiny_overrides"]

HIDDEN = 32
"""Model width."""
HEADS = 4
"""Attention heads (``HIDDEN // HEADS`` is the head dim)."""
KV_HEADS = 2
"""Key/value heads, where the family has grouped-query attention."""
HEAD_DIM = HIDDEN // HEADS
"""Attention head width."""
INTERMEDIATE = 64
"""Dense feed-forward width."""
EXPERT_INTERMEDIATE = 32
"""Per-expert (and shared-expert) feed-forward width of mixture-of-experts families."""
EXPERTS = 4
"""Routed experts of mixture-of-experts families."""
EXPERTS_PER_TOKEN = 2
"""Experts each token is routed to."""
POSITIONS = 128
"""Maximum positions: comfortably above the 16-token sequences the zoo is run with."""
STATE = 16
"""State size of state-space (Mamba-style) mixers."""

# Each group: the field names that mean the same size across families, the value to give them, and whether a
# default of ``None`` is overridden too (``None`` there means "derived from the width", e.g. ``head_dim``) or left
# alone (``None`` there switches a feature off, e.g. ``q_lora_rank``).
_SIZE_GROUPS: tuple[tuple[tuple[str, ...], int, bool], ...] = (
    (("hidden_size", "n_embd", "d_model", "dim", "emb_dim", "embedding_size", "word_embed_proj_dim",
      "input_embedding_size", "output_embedding_size", "attention_hidden_size", "lru_width", "pooler_output_size",
      "backbone_hidden_size", "router_hidden_size", "pronunciation_embed_dim", "shape_embed_dim",
      "hidden_size_global", "adapter_in_dim", "adapter_out_dim", "adapter_input_size"), HIDDEN, False),
    (("hidden_size_per_layer_input",), HEAD_DIM, False),
    (("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "encoder_attention_heads",
      "decoder_attention_heads", "num_encoder_attention_heads", "num_decoder_attention_heads",
      "swa_num_attention_heads", "index_n_heads"), HEADS, False),
    (("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads"), KV_HEADS, True),
    (("head_dim", "swa_head_dim", "attention_head_dim", "attention_head_size", "kv_channels", "d_head", "dim_head",
      "d_kv", "v_head_dim", "qk_rope_head_dim", "qk_nope_head_dim"), HEAD_DIM, True),
    (("index_head_dim",), 2 * HEAD_DIM, False),
    (("rotary_dim",), HEAD_DIM // 2, False),
    (("kv_lora_rank", "q_lora_rank", "o_lora_rank", "hc_lowrank"), 16, False),
    (("block_multiple_of",), 16, False),
    (("intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "d_inner", "dim_ff",
      "dff", "feed_forward_size", "ffn_hidden_size", "intermediate_size_mlp", "dense_intermediate_size"),
     INTERMEDIATE, True),
    (("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
      "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size"),
     EXPERT_INTERMEDIATE, False),
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "zero_expert_num"), EXPERTS, False),
    (("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k"), EXPERTS_PER_TOKEN, False),
    (("n_group", "topk_group", "num_expert_group"), 1, False),
    (("max_position_embeddings", "n_positions", "n_ctx", "context_length", "max_seq_len", "max_source_positions",
      "max_target_positions"), POSITIONS, False),
    (("mamba_d_state", "state_size", "ssm_state_size"), STATE, False),
    (("mamba_d_head", "mamba_head_dim"), HEAD_DIM, False),
    (("mamba_d_ssm",), 2 * HIDDEN, False),
    (("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), HEADS, False),
    (("n_groups", "mamba_n_groups"), 1, False),
    (("mamba_chunk_size", "chunk_size"), 16, False),
    (("linear_num_key_heads", "linear_num_heads"), KV_HEADS, False),
    (("linear_num_value_heads",), HEADS, False),
    (("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), HEAD_DIM, False),
)

_LAYER_FIELDS: tuple[str, ...] = (
    "num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
    "num_encoder_layers", "num_decoder_layers",
)
"""Depth fields; each is set to the requested number of layers."""

_VOCAB_FIELDS: tuple[str, ...] = (
    "vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size",
    "encoder_hash_byte_group_vocab", "pronunciation_vocab_size", "shape_vocab_size",
)
"""Vocabulary fields; each is set to the requested vocabulary size."""

_STOCHASTIC_FIELDS: tuple[str, ...] = ("router_jitter_noise", "input_jitter_noise")
"""Training-time noise that is not named a dropout but makes two forwards differ; zeroed with the dropouts."""


@dataclasses.dataclass(frozen=True)
class _Fix:
    """Fields one family needs on top of the generic shrink, as a function of the depth, and why."""

    reason: str
    fields: Callable[[int], dict[str, Any]]


def _cycle(pattern: list[Any], layers: int) -> list[Any]:
    """``pattern`` repeated to ``layers`` entries."""
    return [pattern[i % len(pattern)] for i in range(layers)]


_DOTS3_SLIDING = {"swa_num_attention_heads": HEADS, "swa_num_key_value_heads": HEADS, "swa_q_lora_rank": 16,
                  "swa_kv_lora_rank": 16, "swa_head_dim": 2 * HEAD_DIM, "swa_qk_nope_head_dim": HEAD_DIM,
                  "swa_v_head_dim": HEAD_DIM}
"""Dots 3 Note's sliding-window layers take their sizes from ``swa_*`` keywords that are not config fields."""
_QWEN4_EXP_INDEXER = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 8,
                      "indexer_compress_ratio": 4}
"""Qwen4-Exp's sparse-attention indexer sizes: its default leaves them unset (None), which the indexer divides."""

_FAMILY_FIXES: dict[str, _Fix] = {
    "cohere_compass_text": _Fix("its default has no RoPE parameters for its layer type, which the rotary embedding "
                                "looks up", lambda layers: {"rope_parameters": {
                                    "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    "dbrx": _Fix("its attention sub-config declares no rope_theta, and the attention clamps by clip_qkv (None)",
                 lambda layers: {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}}),
    "deepseek_v2": _Fix("its default leaves num_experts_per_tok unset (None), which the router needs",
                        lambda layers: {"num_experts_per_tok": EXPERTS_PER_TOKEN}),
    "dots1": _Fix("its default leaves the experts unset (None), which the MoE layers need",
                  lambda layers: {"n_routed_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
                                  "n_shared_experts": 1}),
    "dots3_note": _Fix("sliding-window layer sizes are swa_* keywords, not fields",
                       lambda layers: {"text_config": _DOTS3_SLIDING}),
    "dots3_note_text": _Fix("sliding-window layer sizes are swa_* keywords, not fields",
                            lambda layers: _DOTS3_SLIDING),
    "gemma3n_text": _Fix("the last num_kv_shared_layers layers reuse earlier layers' KV caches, so both attention "
                         "kinds must occur before them",
                         lambda layers: {"layer_types": _cycle(["sliding_attention", "full_attention"], layers),
                                         "num_kv_shared_layers": layers // 2}),
    "gemma4": _Fix("full-attention layers' head width is the global_head_dim keyword (default 512), not a field",
                   lambda layers: {"text_config": {"global_head_dim": 2 * HEAD_DIM}}),
    "gemma4_text": _Fix("full-attention layers' head width is the global_head_dim keyword (default 512), not a field",
                        lambda layers: {"global_head_dim": 2 * HEAD_DIM}),
    "gpt_neo": _Fix("the layer pattern is given as attention_types ([[kinds], repeats]), not a per-layer list",
                    lambda layers: {"attention_types": [[["global", "local"], layers // 2]]
                                    + ([[["global"], 1]] if layers % 2 else [])}),
    "kolibri1_1": _Fix("its sparse indexed attention needs a head width that is a multiple of 16 (NVFP4 rounding), "
                       "scoring heads within one key head's queries, and a pool and window a short sequence exceeds; "
                       "its default layout names layers of a 50-layer model",
                       lambda layers: {"head_dim": 16, "index_num_heads": HEADS // KV_HEADS, "index_topk": 2,
                                       "index_pool_size": 4, "index_compression": 2, "index_num_local_tokens": 2,
                                       "index_num_sink_tokens": 1, "sliding_window": 4, "mlp_only_layers": [0],
                                       "layer_types": _cycle(["sliding_attention", "indexed_attention"], layers),
                                       "index_layers": [1], "kv_source_layers": list(range(layers))}),
    "lfm2_moe": _Fix("its default leaves layer_types unset (None), which the decoder layers index",
                     lambda layers: {"layer_types": _cycle(["conv", "full_attention"], layers)}),
    "mamba2": _Fix("the SSM heads tile the expanded width: num_heads * head_dim must equal expand * hidden_size",
                   lambda layers: {"num_heads": 2 * HIDDEN // HEAD_DIM}),
    "qwen4_exp": _Fix("its default leaves the indexer sizes unset (None)",
                      lambda layers: {"text_config": _QWEN4_EXP_INDEXER}),
    "qwen4_exp_text": _Fix("its default leaves the indexer sizes unset (None)", lambda layers: _QWEN4_EXP_INDEXER),
    "reformer": _Fix("its LM head requires is_decoder; depth is the attn_layers tuple; axial position embeddings "
                     "would tie the sequence length to their shape; chunks must fit a short sequence",
                     lambda layers: {"is_decoder": True, "attn_layers": _cycle(["local", "lsh"], layers),
                                     "axial_pos_embds": False, "local_attn_chunk_length": 8,
                                     "lsh_attn_chunk_length": 8}),
    "xmod": _Fix("each forward needs a language adapter chosen; the default chooses none",
                 lambda layers: {"default_language": "en_XX"}),
    "zamba": _Fix("its one shared transformer block is tied across hybrid layers, so at least two are needed",
                  lambda layers: {"layers_block_type": _cycle(["linear_attention", "hybrid"], layers)}),
    "zaya": _Fix("it supports num_experts_per_tok=1 only", lambda layers: {"num_experts_per_tok": 1}),
}
"""Per-family fields applied after the generic shrink, each with the reason the generic path cannot do it."""

_MULTIMODAL = "multimodal: a text-only step never reaches its {tower} (no gradients there); {sibling}"

SKIP: dict[str, str] = {
    # a plain ``input_ids -> loss`` step does not apply
    "gemma4_assistant": "speculative-decoding draft model: forward needs the target model's inputs_embeds and shared "
                        "KV states, and its config validator rejects a standalone tiny text config",
    "gemma4_unified_assistant": "speculative-decoding draft model: forward needs the target model's inputs_embeds "
                                "and shared KV states",
    "git": "image captioning: the loss drops the first num_image_tokens positions (the image patches it expects "
           "pixel_values for), so a text-only step has no logits left",
    "musicgen": "audio-codebook decoder: input_ids are (batch * num_codebooks, seq) and labels "
                "(batch, seq, num_codebooks), not a plain token step",
    "musicgen_melody": "audio-codebook decoder: input_ids are (batch * num_codebooks, seq) and labels "
                       "(batch, seq, num_codebooks), not a plain token step",
    # float64 unsupported by the modelling code (both run in float32)
    "xglm": "float64 forward fails: attention clamps with torch.full((), finfo(float64).min), made in float32 "
            "(overflow); runs in float32",
    "xlnet": "float64 forward fails: relative position encodings are hard-coded float32; runs in float32",
    # multimodal: towers that a text-only step never reaches
    "gemma3n": "multimodal, and its vision tower (TimmWrapperModel) needs the timm package, not installed; "
               "gemma3n_text covers the decoder",
    "fuyu": _MULTIMODAL.format(tower="image patch projection", sibling="its decoder is a Persimmon"),
    "gemma3": _MULTIMODAL.format(tower="SigLIP vision tower", sibling="gemma3_text covers the decoder"),
    "gemma4": _MULTIMODAL.format(tower="vision and audio towers",
                                 sibling="the audio tower holds the largest block container; gemma4_text covers "
                                         "the decoder"),
    "gemma4_unified": _MULTIMODAL.format(tower="vision embedder (not shrunk by the generic path)",
                                         sibling="gemma4_unified_text covers the decoder"),
    "got_ocr2": _MULTIMODAL.format(tower="vision tower",
                                   sibling="and the tower, not the decoder, holds the largest block container"),
    "moss_transcribe_diarize": _MULTIMODAL.format(tower="audio encoder",
                                                  sibling="its decoder is a Qwen3"),
    "phi4_multimodal": _MULTIMODAL.format(tower="audio and vision encoders",
                                          sibling="and the 24-block audio encoder holds the largest block container; "
                                                  "phi3 covers the decoder"),
}
"""Causal-LM families left out of the zoo, each with the reason."""


def causal_lm_families() -> list[str]:
    """The ``model_type`` of every causal-LM family registered in the installed ``transformers`` (its
    ``AutoModelForCausalLM`` registry), sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _field_defaults(config_class: type[PreTrainedConfig]) -> dict[str, Any]:
    """The config class's dataclass fields (the keyword arguments it accepts) with their defaults."""
    defaults: dict[str, Any] = {}
    for field in dataclasses.fields(config_class):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
        else:
            defaults[field.name] = None
    return defaults


def _is_int(value: Any) -> bool:
    """An int that is not a bool (``True`` is an ``int`` to Python, and a flag to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _remap_token_ids(defaults: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Special-token ids (``*_token_id``, ``*_token_index``) that fall outside the tiny vocabulary, moved inside it:
    ``pad_token_id`` becomes an embedding's ``padding_idx``, which must be a valid row. Distinct ids stay distinct,
    counting down from ``vocab - 1``."""
    names = sorted(n for n in defaults if n.endswith(("_token_id", "_token_ids", "_token_index")))
    remapped: dict[int, int] = {}

    def move(token: Any) -> Any:
        if not _is_int(token) or 0 <= token < vocab:
            return token
        if token not in remapped:
            remapped[token] = vocab - 1 - len(remapped)
        return remapped[token]

    out: dict[str, Any] = {}
    for name in names:
        value = defaults[name]
        if isinstance(value, list):
            moved: Any = [move(t) for t in value]
        else:
            moved = move(value)
        if moved != value:
            out[name] = moved
    return out


def _default_values(config_class: type[PreTrainedConfig]) -> dict[str, Any]:
    """The values of the family's default config after its ``__post_init__`` (which derives lists such as
    ``layer_types``), restricted to its fields; the bare field defaults where the default config itself does not
    construct."""
    defaults = _field_defaults(config_class)
    try:
        instance = config_class()
    except Exception:  # noqa: BLE001 -- some families' own defaults fail their validation
        return defaults
    # read the instance's own attributes: a heterogeneous (per-layer) config refuses ``getattr`` of per-layer fields
    return {name: vars(instance).get(name, value) for name, value in defaults.items()}


def _resize_per_layer_lists(values: dict[str, Any], old_layers: int | None, layers: int) -> dict[str, Any]:
    """Fields holding one entry per layer (``layer_types``, per-layer widths, ...), cut (or cycled) to ``layers``
    entries. A per-layer list of widths (ints under an ``intermediate`` name) becomes ``INTERMEDIATE`` each."""
    out: dict[str, Any] = {}
    if not old_layers or old_layers == layers:
        return out
    for name, value in values.items():
        if isinstance(value, (list, tuple)) and len(value) == old_layers:
            resized = [value[i % old_layers] for i in range(layers)]
            if "intermediate" in name and all(_is_int(v) for v in resized):
                resized = [INTERMEDIATE] * layers
            out[name] = resized
    return out


def _sub_config_classes(config_class: type[PreTrainedConfig]) -> dict[str, type[PreTrainedConfig]]:
    """The concrete class of each sub-config (``text_config``, ``vision_config``, ...). A sub-config declared as
    ``AutoConfig`` is resolved through the family's default composite config."""
    declared: dict[str, Any] = dict(getattr(config_class, "sub_configs", None) or {})
    resolved: dict[str, type[PreTrainedConfig]] = {}
    default_instance: PreTrainedConfig | None = None
    for name, cls in declared.items():
        if isinstance(cls, type) and issubclass(cls, PreTrainedConfig) and cls is not AutoConfig \
                and dataclasses.is_dataclass(cls):
            resolved[name] = cls
            continue
        if default_instance is None:
            # raises where the family's own default fails validation: better than leaving a full-size sub-config
            default_instance = config_class()
        sub = getattr(default_instance, name, None)
        if isinstance(sub, PreTrainedConfig):
            resolved[name] = type(sub)
    return resolved


def tiny_overrides(config_class: type[PreTrainedConfig], *, layers: int = 4, vocab: int = 64) -> dict[str, Any]:
    """The keyword arguments that shrink ``config_class`` (only fields it declares), sub-configs included as
    nested dicts."""
    defaults = _field_defaults(config_class)
    out: dict[str, Any] = {}
    for names, value, override_none in _SIZE_GROUPS:
        for name in names:
            if name in defaults and (_is_int(defaults[name]) or (override_none and defaults[name] is None)):
                out[name] = value
    old_layers = next((defaults[n] for n in _LAYER_FIELDS if _is_int(defaults.get(n))), None)
    for name in _LAYER_FIELDS:
        if _is_int(defaults.get(name)):
            out[name] = layers
    for name in _VOCAB_FIELDS:
        if _is_int(defaults.get(name)):
            out[name] = vocab
    for name, value in defaults.items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name or "layerdrop" in name
                                         or name in _STOCHASTIC_FIELDS):
            out[name] = 0.0
    out.update(_remap_token_ids(defaults, vocab))
    per_layer = _resize_per_layer_lists(_default_values(config_class), old_layers, layers)
    out.update({name: value for name, value in per_layer.items() if name not in out})
    if "kv_lora_rank" in defaults:
        # multi-head latent attention decompresses keys and values per attention head: no grouped-query heads
        for name in ("num_key_value_heads", "num_kv_heads"):
            if name in out:
                out[name] = HEADS
    if "use_cache" in defaults:
        out["use_cache"] = False
    for name, sub_class in _sub_config_classes(config_class).items():
        out[name] = tiny_overrides(sub_class, layers=layers, vocab=vocab)
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``extra``, nested dicts (sub-configs) merged rather than replaced."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def tiny_config(model_type: str, *, layers: int = 4, vocab: int = 64, **fields: Any) -> PreTrainedConfig:
    """A tiny config of family ``model_type``: width 32, 4 heads (2 key/value heads where the family has them),
    feed-forward 64, ``vocab`` tokens, ``layers`` layers, 128 positions, every dropout 0, ``use_cache=False``;
    ``tie_word_embeddings`` is left at the family's default. ``fields`` are applied last (a dict value for a
    sub-config is merged into its overrides)."""
    config_class = CONFIG_MAPPING[model_type]
    kwargs = tiny_overrides(config_class, layers=layers, vocab=vocab)
    if model_type in _FAMILY_FIXES:
        kwargs = _merge(kwargs, _FAMILY_FIXES[model_type].fields(layers))
    kwargs = _merge(kwargs, fields)
    config = AutoConfig.for_model(model_type, **kwargs)
    _disable_cache(config)
    return config


def _disable_cache(config: PreTrainedConfig) -> None:
    """``use_cache=False`` on the config and every sub-config (a sub-config's own default would otherwise stand)."""
    for sub in _configs_in(config):
        sub.use_cache = False


def _configs_in(config: PreTrainedConfig) -> Iterable[PreTrainedConfig]:
    """``config`` and its sub-configs, recursively."""
    yield config
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, PreTrainedConfig):
            yield from _configs_in(sub)


def _causal_lm_config(config: PreTrainedConfig) -> tuple[type[PreTrainedModel], PreTrainedConfig]:
    """The ``AutoModelForCausalLM`` class registered for ``config`` and the config it takes: the config itself, or
    the sub-config of the class's own config type where a composite config is registered for a decoder-only class
    (MusicGen's ``MusicgenForCausalLM`` takes the composite's ``decoder``)."""
    model_class: type[PreTrainedModel] = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if not isinstance(config, model_class.config_class):
        for sub in _configs_in(config):
            if isinstance(sub, model_class.config_class):
                return model_class, sub
    # otherwise the class takes the config as it is (a family registered under another family's class)
    return model_class, config


def build(model_type: str, dtype: torch.dtype = torch.float64, *, seed: int = 0, layers: int = 4,
          vocab: int = 64, **fields: Any) -> PreTrainedModel:
    """``AutoModelForCausalLM`` of family ``model_type`` built from :func:`tiny_config` (``fields`` passed on) in
    ``dtype``, its weights initialised from ``seed``; left in training mode.

    In float64, mixture-of-experts layers use transformers' ``"eager"`` experts implementation: the default,
    ``"grouped_mm"``, calls ``torch._grouped_mm``, which has no float64 kernel. The class is instantiated with
    ``_from_config``, as ``AutoModelForCausalLM.from_config`` itself does, because the config it takes may be a
    sub-config that the auto mapping does not list (see ``_causal_lm_config``)."""
    model_class, config = _causal_lm_config(tiny_config(model_type, layers=layers, vocab=vocab, **fields))
    options: dict[str, Any] = {"dtype": dtype}
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        options["experts_implementation"] = "eager"
    torch.manual_seed(seed)
    model = model_class._from_config(config, **options)
    return model.train()
