"""The ``model`` config section: the decoder's architecture (dense or MoE) and how to run it.
Re-exported by ``meshrl.configs.schema``; cross-section rules (the mesh against the experts)
live in ``configs/cross_section.py``."""

from __future__ import annotations

import dataclasses
from typing import Literal

from meshrl.configs.fields import ConfigError, Section, at_least, field

DType = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
    _section = "model"
    arch: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"] = field(
        "llama", "Decoder family: llama (Llama 3.x), qwen2 (q/k/v bias), qwen3 (q/k RMSNorm), "
                 "qwen3_moe (Qwen3 attention, MoE FFNs), mixtral (Llama attention, MoE FFNs).")
    vocab_size: int = field(256, "Vocabulary size.", at_least(1))
    hidden_size: int = field(64, "Model (embedding) width.", at_least(1))
    intermediate_size: int = field(172, "SwiGLU MLP hidden width.", at_least(1))
    num_layers: int = field(2, "Number of decoder layers.", at_least(1))
    num_heads: int = field(4, "Query heads.", at_least(1))
    num_kv_heads: int = field(2, "Key/value heads (GQA); must divide num_heads.", at_least(1))
    hf_path: str = field("", "Local Hugging Face checkpoint directory; empty: random init.")
    tokenizer: str = field(
        "auto", "auto: the checkpoint's own <model.hf_path>/tokenizer.json (an error when it has "
                "none, never a fallback), or the built-in byte tokenizer without model.hf_path; "
                "char: the built-in byte tokenizer on purpose (with model.hf_path only for a "
                "checkpoint that ships no tokenizer.json); else a local directory holding "
                "tokenizer.json.")
    head_dim: int = field(0, "Per-head width; 0 means hidden_size // num_heads.", at_least(0))
    rope_theta: float = field(10000.0, "RoPE base frequency.", at_least(1.0))
    rope_scaling: Literal["none", "llama3", "linear"] = field("none", "RoPE scaling rule.")
    rope_scaling_factor: float = field(1.0, "RoPE scaling factor.", at_least(1.0))
    rope_low_freq_factor: float = field(1.0, "llama3 RoPE low-frequency factor.", at_least(0.0))
    rope_high_freq_factor: float = field(4.0, "llama3 RoPE high-frequency factor.", at_least(0.0))
    rope_original_max_position: int = field(8192, "llama3 RoPE original context length.",
                                            at_least(1))
    max_position_embeddings: int = field(2048, "Longest supported position: trainer.seq_len and "
                                               "sampler.max_len must fit it.", at_least(1))
    rms_norm_eps: float = field(1e-6, "RMSNorm epsilon.", at_least(0.0))
    tie_embeddings: bool = field(False, "Share the input embedding with the output head.")
    attention_bias: bool = field(False, "Bias on q/k/v projections (Qwen2).")
    qk_norm: bool = field(False, "RMSNorm on per-head q and k (Qwen3).")
    param_dtype: DType = field("float32", "Dtype of stored parameters (master weights).")
    compute_dtype: DType = field("float32", "Dtype of activations and matmuls.")
    attention: Literal["blockwise", "einsum", "cudnn", "splash"] = field(
        "blockwise", "Attention kernel of the no-cache forward (training, logprobs) and of "
                     "prefills over 512 tokens: blockwise (pure JAX online softmax in blocks of "
                     "<= 512 queries x keys, any platform; up to 512 tokens the einsum itself), "
                     "einsum (the reference: full L x L float32 scores), cudnn (GPU, needs "
                     "compute_dtype bfloat16/float16), splash (TPU Pallas). Decode always "
                     "attends over the cache in one pass. See docs/attention.md.")
    remat: Literal["none", "full", "dots"] = field(
        "none", "Rematerialisation policy per layer: none, full, or save only matmul outputs.")
    scan_layers: bool = field(False, "Run layers with a scan (faster compile, one layer's code).")
    mlp_chunk: int = field(
        0, "Tokens per chunk of the MLP in the no-cache forward (training, logprobs): the "
           "[tokens, intermediate_size] activations are built and recomputed (remat) that many "
           "tokens at a time. 0: all at once. For long sequences with remat, where one layer's "
           "recomputed MLP dominates the step's memory.", at_least(0))
    context_attention: Literal["all_gather", "ring"] = field(
        "all_gather", "Attention when the sequence is sharded over mesh.context (training): "
                      "all_gather (gather K/V over context, then attend), ring (K/V blocks "
                      "passed around the ring with ppermute, online softmax). See "
                      "docs/context.md.")
    context_balance: bool = field(
        True, "With mesh.context > 1, lay each sequence out in 2 x context chunks so rank i "
              "holds chunks i and 2*context-1-i (even causal work per rank); needs lengths "
              "divisible by 2 x context.")
    num_experts: int = field(0, "Routed experts per MoE layer; 0: a dense decoder. Needs "
                                "model.arch qwen3_moe or mixtral.", at_least(0))
    num_experts_per_tok: int = field(2, "Experts each token is routed to (top-k).", at_least(1))
    moe_intermediate_size: int = field(
        0, "Each expert's FFN hidden width; 0 means intermediate_size (which stays the width of "
           "the dense layers).", at_least(0))
    norm_topk_prob: bool = field(True, "Renormalise the top-k router probabilities to sum to 1 "
                                       "(Qwen3-MoE's norm_topk_prob).")
    router: Literal["softmax_topk", "topk_softmax"] = field(
        "softmax_topk", "Router: softmax over all experts then top-k (Qwen3-MoE), or top-k "
                        "logits then softmax over them (Mixtral). Router math is float32.")
    decoder_sparse_step: int = field(1, "Every this many layers is sparse (Qwen3-MoE).",
                                     at_least(1))
    mlp_only_layers: tuple[int, ...] = field((), "Layers that keep a dense MLP (Qwen3-MoE).")
    moe_impl: Literal["auto", "ragged_dot", "blocked", "dense"] = field(
        "auto", "Expert FFN kernel: ragged_dot (jax.lax.ragged_dot grouped matmul; native on "
                "TPU/GPU), blocked (tokens sorted by expert in blocks of one expert, one batched "
                "matmul; fast on CPU), dense (every expert on every token, masked: the "
                "reference). auto: ragged_dot on TPU/GPU, blocked on CPU. See docs/moe.md.")
    capacity_factor: float = field(
        0.0, "0: dropless routing. > 0: each expert takes at most capacity_factor * tokens * "
             "top_k / num_experts copies per shard; the rest are dropped (counted in "
             "moe/dropped_frac).", at_least(0.0))
    router_aux_loss_coef: float = field(0.001, "Weight of the load-balancing loss (HF's "
                                               "router_aux_loss_coef).", at_least(0.0))
    router_z_loss_coef: float = field(0.0, "Weight of the router z-loss (ST-MoE).",
                                      at_least(0.0))

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_kv_heads = {self.num_kv_heads}: must divide "
                              f"model.num_heads = {self.num_heads}")
        if self.head_dim == 0 and self.hidden_size % self.num_heads:
            raise ConfigError(f"model.hidden_size = {self.hidden_size}: must be divisible by "
                              f"model.num_heads = {self.num_heads} when model.head_dim = 0")
        if self.attention == "cudnn" and self.compute_dtype == "float32":
            raise ConfigError("model.attention = 'cudnn': needs model.compute_dtype = "
                              "'bfloat16' or 'float16' (cuDNN flash attention has no float32 "
                              "kernel), got 'float32'")

        self._validate_moe()

    def _validate_moe(self) -> None:
        moe_arch = self.arch in ("qwen3_moe", "mixtral")
        if moe_arch != (self.num_experts > 0):
            raise ConfigError(f"model.num_experts = {self.num_experts} with model.arch = "
                              f"{self.arch!r}: qwen3_moe and mixtral need num_experts >= 1, "
                              f"the dense archs 0")
        if not moe_arch:
            return
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"model.num_experts_per_tok = {self.num_experts_per_tok}: must be "
                              f"<= model.num_experts = {self.num_experts}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"model.mlp_only_layers = {self.mlp_only_layers}: {bad} outside "
                              f"[0, model.num_layers = {self.num_layers})")
        if self.arch == "mixtral" and (self.mlp_only_layers or self.decoder_sparse_step != 1):
            raise ConfigError(f"model.arch = 'mixtral': every layer is sparse, so "
                              f"model.mlp_only_layers = {self.mlp_only_layers} must be () and "
                              f"model.decoder_sparse_step = {self.decoder_sparse_step} must be 1")
        kinds = {self.is_sparse_layer(i) for i in range(self.num_layers)}
        if self.scan_layers and len(kinds) > 1:
            raise ConfigError(f"model.scan_layers = True: needs every layer alike, but "
                              f"model.mlp_only_layers = {self.mlp_only_layers} and "
                              f"model.decoder_sparse_step = {self.decoder_sparse_step} mix dense "
                              f"and sparse layers")
        if self.moe_impl == "dense" and self.capacity_factor > 0:
            raise ConfigError(f"model.capacity_factor = {self.capacity_factor}: "
                              f"model.moe_impl = 'dense' is dropless only (set 0)")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def resolved_moe_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def is_sparse_layer(self, layer: int) -> bool:
        """Qwen3-MoE's rule: layer i is sparse unless listed in ``mlp_only_layers``, when
        ``(i + 1) % decoder_sparse_step == 0``; a dense decoder has none."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)
