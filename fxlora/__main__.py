"""``python -m fxlora``: what fxlora is, its version, how to run the demo and where the docs are."""

from __future__ import annotations

from fxlora import __version__

ABOUT = f"""fxlora {__version__}: serve many LoRA adapters on one Hugging Face transformers model.
Dynamo traces the model and fxlora rewrites its FX graph so that every targeted linear and
embedding reads a pool of adapter slots; each row of a batch picks its own adapter, or none.

demo:  python -m fxlora.demo    a tiny random Llama and three PEFT adapters, checked against
                                PEFT; runs on the CPU (options: python -m fxlora.demo --help)
docs:  https://github.com/fxlora/fxlora: README.md, docs/usage.md (the API), CHANGELOG.md
"""


def main() -> None:
    print(ABOUT, end="")


if __name__ == "__main__":
    main()
