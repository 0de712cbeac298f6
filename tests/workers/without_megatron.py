"""Run attnres-dist's Hugging Face export, or load its result, with DeepSpeed and Megatron-Core
made uninstalled for this interpreter.

    python tests/workers/without_megatron.py export SOURCE OUT
    python tests/workers/without_megatron.py load OUT TOKENS.pt PROMPT NEW_TOKENS

``sys.modules[name] = None`` makes ``import name`` raise ImportError and
``importlib.util.find_spec(name)`` answer None, exactly as for a package that is not
installed. ``load`` prints one JSON line: the logits for TOKENS (saved to OUT/../logits.pt),
transformers' greedy ``generate()`` continuation, and whether any module of the hidden
packages was imported after all.
"""

import sys

HIDDEN = ("deepspeed", "megatron")
for _name in HIDDEN:
    sys.modules[_name] = None  # "not installed"

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402


def _leaked() -> list[str]:
    return sorted(
        m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in HIDDEN
    )


def export(source: str, out: str) -> None:
    from attnres_dist.cli import main

    code = main(["export", source, "--format", "hf", "--output", out])
    print(json.dumps({"code": code, "leaked": _leaked()}))


def load(out: str, tokens_path: str, prompt: str, new_tokens: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    tokens = torch.load(tokens_path)
    with torch.no_grad():
        logits = model(tokens).logits
    torch.save(logits, Path(tokens_path).with_name("hf_logits.pt"))
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    ids = model.generate(**inputs, max_new_tokens=int(new_tokens), do_sample=False)
    text = tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    print(json.dumps({"greedy": text, "class": type(model).__name__, "leaked": _leaked()}))


if __name__ == "__main__":
    {"export": export, "load": load}[sys.argv[1]](*sys.argv[2:])
