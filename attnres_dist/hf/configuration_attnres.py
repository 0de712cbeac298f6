"""Hugging Face configuration of an exported AttnRes model (``model_type: attnres``).

Shipped inside every ``attnres-dist export --format hf`` directory next to
``modeling_attnres.py``; depends on transformers only. The fields mirror the trainer's model
config: ``vocab_size`` is the tokenizer's vocabulary (what the logits cover) and
``padded_vocab_size`` the rows of the embedding matrix (the trainer pads the vocabulary so it
splits over tensor-parallel ranks; padding ids are never produced by the tokenizer).
"""

from transformers import PretrainedConfig

ATTNRES_MODES = ("baseline", "full", "block", "delta_full", "delta_block")


class AttnResConfig(PretrainedConfig):
    model_type = "attnres"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size=257,
        padded_vocab_size=384,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rope_llama3_factor=None,
        rms_norm_eps=1e-5,
        attnres_mode="block",
        attnres_block_size=2,
        attnres_source_scaled_eps=False,
        depth_attention_eps=1e-6,
        num_experts=0,
        num_experts_per_tok=2,
        moe_intermediate_size=None,
        shared_expert_intermediate_size=None,
        moe_layers=None,
        router_dtype="fp32",
        router_pre_softmax=False,
        qk_norm=False,
        tie_word_embeddings=True,
        use_cache=True,
        bos_token_id=None,
        eos_token_id=256,
        pad_token_id=None,
        **kwargs,
    ):
        if attnres_mode not in ATTNRES_MODES:
            raise ValueError(f"attnres_mode {attnres_mode!r}; allowed: {', '.join(ATTNRES_MODES)}")
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        # Llama 3's RoPE scaling (bands 1 and 4 over 8192 original positions); None = none
        self.rope_llama3_factor = rope_llama3_factor
        self.rms_norm_eps = rms_norm_eps
        self.attnres_mode = attnres_mode
        self.attnres_block_size = attnres_block_size
        # each norm after a depth mix of n sources uses rms_norm_eps / n^2 (Delta: times
        # (1 + 1/n)^2): an imported model is exact at step 0 (modeling_attnres.norm_eps)
        self.attnres_source_scaled_eps = attnres_source_scaled_eps
        self.depth_attention_eps = depth_attention_eps
        # mixture of experts (0 experts: dense): the layers in moe_layers route each token to
        # num_experts_per_tok SwiGLU experts of moe_intermediate_size (the softmax over the
        # chosen router logits, computed in router_dtype), plus a shared expert if sized
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size or intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.moe_layers = list(moe_layers or [])
        self.router_dtype = router_dtype
        self.router_pre_softmax = router_pre_softmax  # each chosen expert's softmax over all
        self.qk_norm = qk_norm  # each head's query and key RMSNorm before RoPE (Qwen3's)
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
