"""The drafter config, read from a checkpoint's config.json.

Keys are looked up in ``dflash_config`` first and then at the top level, because
DFlash v1 checkpoints keep ``block_size`` (and some others) at the top level.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

V1_ARCH = "DFlashDraftModel"
V2_ARCH = "DFlash2DraftModel"


REQUIRED_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "vocab_size", "block_size", "mask_token_id",
)


class DrafterConfigError(ValueError):
    """A drafter config.json that cannot describe a DFlash drafter."""


def default_target_layer_ids(num_target_layers: int, n: int) -> List[int]:
    if n == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]


def _lookup(cfg: Dict[str, Any]) -> Callable:
    """``get(key, default)``: the key's non-null value in ``dflash_config``, else at the
    top level, else ``default``."""
    dflash = cfg.get("dflash_config") or {}

    def get(key, default=None):
        if key in dflash and dflash[key] is not None:
            return dflash[key]
        if key in cfg and cfg[key] is not None:
            return cfg[key]
        return default

    return get


def _version(archs: list) -> int:
    if V2_ARCH in archs:
        return 2
    if V1_ARCH in archs:
        return 1
    raise DrafterConfigError(
        f"config.json architectures {archs!r} name no DFlash drafter; "
        f"expected [{V2_ARCH!r}] (DFlash 2) or [{V1_ARCH!r}] (DFlash v1)"
    )


def _target_layer_ids(get: Callable, num_target_layers) -> list:
    """The tapped target layers: given, or spread over ``num_target_layers``."""
    ids = get("target_layer_ids")
    if ids is not None:
        return ids
    if num_target_layers is None:
        raise DrafterConfigError("drafter config.json has neither target_layer_ids nor num_target_layers")
    return default_target_layer_ids(int(num_target_layers), int(get("num_target_features", 1) or 1))


def _layer_types(get: Callable, layers: int, sliding_window) -> list:
    """One attention type per drafter layer: given, or all sliding / all full."""
    layer_types = get("layer_types")
    if not layer_types:
        use_sliding = bool(get("use_sliding_window", False)) and sliding_window
        layer_types = ["sliding_attention" if use_sliding else "full_attention"] * layers
    if len(layer_types) != layers:
        raise DrafterConfigError(f"layer_types has {len(layer_types)} entries for {layers} layers")
    if "sliding_attention" in layer_types and not sliding_window:
        raise DrafterConfigError("layer_types has sliding layers but no sliding_window")
    return layer_types


@dataclass
class DrafterConfig:
    version: int  # 1 = DFlash, 2 = DFlash 2
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: List[int]
    num_target_layers: Optional[int] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 40960
    layer_types: List[str] = field(default_factory=list)
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    input_embedding_scale: float = 1.0
    draft_vocab_size: Optional[int] = None  # an extension: see Drafter.draft_vocab
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def block_is_causal(self, layer: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        return self.is_sliding(layer)

    @classmethod
    def from_dict(cls, cfg: Dict[str, Any]) -> "DrafterConfig":
        get = _lookup(cfg)
        version = _version(cfg.get("architectures") or [])
        missing = [k for k in REQUIRED_KEYS if get(k) is None]
        if missing:
            raise DrafterConfigError(f"drafter config.json is missing {', '.join(missing)}")
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        layers = int(get("num_hidden_layers"))
        num_target_layers = get("num_target_layers")
        ids = _target_layer_ids(get, num_target_layers)
        sliding_window = get("sliding_window")
        layer_types = _layer_types(get, layers, sliding_window)
        block_size = int(get("block_size"))
        if block_size < 2:
            raise DrafterConfigError(f"block_size must be at least 2, got {block_size}")
        conf = cls(
            version=version,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim", hidden // heads)),
            intermediate_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(get("rope_theta", 1000000.0)),
            rope_scaling=get("rope_scaling"),
            max_position_embeddings=int(get("max_position_embeddings", 40960)),
            block_size=block_size,
            mask_token_id=int(get("mask_token_id")),
            target_layer_ids=[int(i) for i in ids],
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            layer_types=list(layer_types),
            sliding_window=None if sliding_window is None else int(sliding_window),
            is_causal=get("is_causal"),
            conv_kernel_size=int(get("conv_kernel_size", 2)),
            conv_group_size=int(get("conv_group_size", 16)),
            selector_rank=int(get("selector_rank", 256)),
            selector_top_k=int(get("selector_top_k", 16)),
            output_multiplier=float(get("output_multiplier", 1.0)),
            final_logit_softcapping=float(get("final_logit_softcapping", 0.0) or 0.0),
            input_embedding_scale=float(get("input_embedding_scale", 1.0)),
            draft_vocab_size=None if get("draft_vocab_size") is None else int(get("draft_vocab_size")),
            raw=dict(cfg),
        )
        conf.validate()
        return conf

    def validate(self):
        """Raise DrafterConfigError where the draft vocabulary or DFlash 2's conv cannot work."""
        n = self.draft_vocab_size
        if n is not None and not (self.selector_top_k if self.version == 2 else 1) <= n <= self.vocab_size:
            raise DrafterConfigError(
                f"draft_vocab_size {n} must lie between the selector's top-k and vocab_size {self.vocab_size}"
            )
        if self.version == 2:
            if self.conv_kernel_size != 2:
                raise DrafterConfigError(
                    f"conv_kernel_size {self.conv_kernel_size} is not supported (DFlash 2 uses 2 taps)"
                )
            if self.hidden_size % self.conv_group_size:
                raise DrafterConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by conv_group_size {self.conv_group_size}"
                )

    def to_dict(self) -> Dict[str, Any]:
        """The config.json of a checkpoint in the published format."""
        out = {k: v for k, v in self.raw.items() if k != "dflash_config"}
        out.update(
            architectures=[V2_ARCH if self.version == 2 else V1_ARCH],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            layer_types=self.layer_types,
            sliding_window=self.sliding_window,
            num_target_layers=self.num_target_layers,
            block_size=self.block_size,
            tie_word_embeddings=False,
        )
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        dflash = dict(
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            target_layer_ids=self.target_layer_ids,
        )
        if self.version == 2:
            dflash.update(
                conv_kernel_size=self.conv_kernel_size,
                conv_group_size=self.conv_group_size,
                selector_rank=self.selector_rank,
                selector_top_k=self.selector_top_k,
            )
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.draft_vocab_size:
            dflash["draft_vocab_size"] = self.draft_vocab_size
        out["dflash_config"] = dflash
        return out
