# SPDX-License-Identifier: Apache-2.0
"""Build tiny random-weight models with a real tokenizer, without downloads.

Used by the tests, ``make serve`` and the benchmarks. Two shapes:

* ``qwen3``: Qwen3 layout, ChatML template, no BOS token (exactness tests);
* ``llama``: Llama layout, adds a BOS token (``<s>``) to every encode.

The tokenizer is a byte-level BPE trained with HF ``tokenizers`` on a small
built-in corpus, so text round-trips and stop strings behave as with a real
model. Weights are float32 (exact comparison with HF transformers) and drawn
from a fixed seed, so the same arguments always give the same model.
Head dim is 64: vLLM's CPU attention kernel rejects smaller ones.
"""

import json
from pathlib import Path

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A beautiful sunset over the ocean
paints the sky in orange, pink and gold. Hidden states are the activations of a
language model between its layers; researchers read them to build probes and
classifiers, to verify inference, and to condition image models on text.
Once upon a time there was a small robot who loved to count: one, two, three,
four, five, six, seven, eight, nine, ten. Hello world! How are you today?
I am fine, thank you. What is the capital of France? Paris is the capital of
France. The engine schedules requests, runs the model and samples tokens.
Prefix caching reuses the key and value blocks of a shared prompt prefix.
Chunked prefill splits a long prompt into several steps under a token budget.
def add(a, b): return a + b  # numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000
Stop. Stop here. The end. <think> </think> user assistant system
"""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _train_tokenizer(vocab_size: int, specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _CORPUS.splitlines() * 4
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def build_tiny_model(
    out: str | Path,
    arch: str = "qwen3",
    num_layers: int = 4,
    hidden_size: int = 128,
    vocab_size: int = 512,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> Path:
    """Write a model directory loadable by vLLM and HF transformers; its path.

    Skips the work when ``out`` already holds a model built with the same
    arguments (recorded in ``tiny_model.json``).
    """
    import torch
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    recipe = dict(arch=arch, num_layers=num_layers, hidden_size=hidden_size,
                  vocab_size=vocab_size, intermediate_size=intermediate_size,
                  max_position_embeddings=max_position_embeddings, seed=seed,
                  version=1)
    stamp = out / "tiny_model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return out
    out.mkdir(parents=True, exist_ok=True)

    head_dim = 64
    num_heads = max(1, hidden_size // head_dim)
    kv_heads = 1 if num_heads == 1 else num_heads // 2
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="float32",
        initializer_range=0.05,
    )
    if arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tok = _train_tokenizer(vocab_size, specials)
        ids = {s: tok.token_to_id(s) for s in specials}
        config = Qwen3Config(bos_token_id=ids["<|endoftext|>"],
                             eos_token_id=ids["<|im_end|>"], **common)
        model_cls = Qwen3ForCausalLM
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|im_end|>",
            pad_token="<|endoftext|>", additional_special_tokens=specials[1:])
        hf_tok.chat_template = CHATML_TEMPLATE
    elif arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        specials = ["<unk>", "<s>", "</s>"]
        tok = _train_tokenizer(vocab_size, specials)
        bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
        common.pop("head_dim")
        config = LlamaConfig(bos_token_id=bos, eos_token_id=eos, **common)
        model_cls = LlamaForCausalLM
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
            unk_token="<unk>", pad_token="</s>")
        hf_tok.chat_template = CHATML_TEMPLATE
    else:
        raise ValueError(f"unknown arch {arch!r}; use 'qwen3' or 'llama'")

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    stamp.write_text(json.dumps(recipe))
    return out
