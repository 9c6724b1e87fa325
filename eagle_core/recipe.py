"""Recipes: what a training run needs beyond the data, per target, in small checked-in TOML files.

    eagle_core/recipes/<name>.toml    draft_vocab_size, lr and schedule, ttt_steps, max_length, tokens_per_batch,
                                      aux_layer_ids, gpus_per_target, [tree] for serving; `source` names where
                                      the values come from, `targets` the targets the recipe is for

`REFERENCE` (reference.toml) is the home of the library's defaults: `DraftConfig`, `TrainConfig` and the job
configs read theirs from it. `resolve_recipe` picks the recipe of a run: `--recipe NAME|FILE` when given, else
the shipped recipe whose `targets` names the target, else one derived by `derive_recipe` from the target's size
and vocabulary (`RULE` says how). Jobs print the recipe in force and why at start; flags override its values.

Nothing here loads weights: `TargetShape.of` reads a target's config and counts its parameters on the meta device.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
SCHEDULES = ("cosine",)  # warm-up, then cosine to min_lr_ratio (eagle_core.ttt.warmup_cosine)
# Targets below this many parameters get the CPU-scale training values (the SmolLM2 recipe's), larger ones the
# reference values; both take the draft vocabulary min(reference's, target's) and GPUs from the weights' size.
SMALL_TARGET_PARAMS = 1_000_000_000
GPU_MEMORY_GIB = 80.0  # a GPU's memory when none is given (A100/H100 80 GB)
# Weights take this share of a GPU that holds a target copy; the rest is activations of the forward batch.
WEIGHTS_SHARE = 0.8
RULE = ("no shipped recipe names the target: the reference recipe's values (the SmolLM2 recipe's training values "
        f"below {SMALL_TARGET_PARAMS / 1e9:g}B parameters), draft vocabulary min(32000, the target's), GPUs per target "
        f"copy = bf16 weights / ({WEIGHTS_SHARE:g} x GPU memory), rounded up")


class RecipeError(ValueError):
    """A recipe that does not exist or does not make sense."""


@dataclass(frozen=True)
class TreeShape:
    """The draft tree the recipe serves with (eagle_core.tree.TreeConfig's sizes)."""

    top_k: int
    depth: int
    total_tokens: int


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    source: str  # where the values come from (a paper, a peer's config file, this project's measurements)
    draft_vocab_size: int
    lr: float  # peak learning rate (AdamW)
    schedule: str  # "cosine": linear warm-up, then cosine down to min_lr_ratio x lr
    warmup_ratio: float
    min_lr_ratio: float
    ttt_steps: int
    max_length: int  # tokens per training conversation
    tokens_per_batch: int  # real tokens per optimiser step, over all workers together
    aux_layer_ids: tuple[int, ...] | None  # output_hidden_states indices; None: [2, N//2, N-3]
    gpus_per_target: int  # GPUs holding one copy of the target (extraction, streaming, serving)
    tree: TreeShape
    targets: tuple[str, ...] = ()  # target names and hub ids this recipe is for
    path: str | None = None  # the file it was read from
    why: str = ""  # how it was chosen for this run (set by resolve_recipe)

    def __post_init__(self):
        problems = []
        for name in ("draft_vocab_size", "ttt_steps", "max_length", "tokens_per_batch", "gpus_per_target"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < 1):
            problems.append(f"lr must be in (0, 1), got {self.lr!r}")
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not 0 <= self.warmup_ratio < 1:
            problems.append(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.aux_layer_ids is not None and (len(self.aux_layer_ids) != 3 or min(self.aux_layer_ids) < 0):
            problems.append(f"aux_layer_ids must be three non-negative layer ids (or empty), got {self.aux_layer_ids}")
        if min(self.tree.top_k, self.tree.depth, self.tree.total_tokens) < 1:
            problems.append(f"tree sizes must be positive, got {self.tree}")
        if problems:
            raise RecipeError(f"recipe {self.name!r}{f' ({self.path})' if self.path else ''}: " + "; ".join(problems))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Recipe":
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError as err:
            raise RecipeError(f"recipe file not found: {path}") from err
        except tomllib.TOMLDecodeError as err:
            raise RecipeError(f"recipe {path} is not valid TOML: {err}") from err
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: dict, path: str | None = None) -> "Recipe":
        where = path or "recipe"
        known = {f.name for f in fields(cls)} - {"path", "why"}
        unknown = sorted(set(data) - known)
        if unknown:  # a typo would otherwise silently fall back to nothing
            raise RecipeError(f"{where}: unknown keys {unknown} (known: {sorted(known)})")
        missing = sorted(known - set(data) - {"targets"})
        if missing:
            raise RecipeError(f"{where}: missing keys {missing}")
        tree = data["tree"]
        if not isinstance(tree, dict) or set(tree) != {"top_k", "depth", "total_tokens"}:
            raise RecipeError(f"{where}: [tree] needs exactly top_k, depth, total_tokens, got {tree!r}")
        aux = data["aux_layer_ids"]
        return cls(**{**data, "tree": TreeShape(**tree), "aux_layer_ids": tuple(aux) if aux else None,
                      "targets": tuple(data.get("targets", ())), "source": " ".join(data["source"].split()),
                      "path": path})

    def training_values(self) -> dict:
        """The values jobs take from the recipe, by the name of their option."""
        return {"draft_vocab_size": self.draft_vocab_size, "lr": self.lr, "warmup_ratio": self.warmup_ratio,
                "min_lr_ratio": self.min_lr_ratio, "ttt_steps": self.ttt_steps, "max_length": self.max_length,
                "tokens_per_batch": self.tokens_per_batch,
                "aux_layer_ids": list(self.aux_layer_ids) if self.aux_layer_ids else None,
                "gpus_per_target": self.gpus_per_target}

    def tree_config(self):
        from eagle_core.tree import TreeConfig

        return TreeConfig(**asdict(self.tree))

    def summary(self) -> str:
        aux = list(self.aux_layer_ids) if self.aux_layer_ids else "[2, N//2, N-3]"
        return (f"{self.name}: draft vocab {self.draft_vocab_size}, lr {self.lr:g} ({self.schedule}, warm-up "
                f"{self.warmup_ratio:g}, floor {self.min_lr_ratio:g}), {self.ttt_steps} TTT steps, max length "
                f"{self.max_length}, {self.tokens_per_batch} tokens per step, aux layers {aux}, "
                f"{self.gpus_per_target} GPU(s) per target copy, tree {self.tree.top_k}/{self.tree.depth}/"
                f"{self.tree.total_tokens}")


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


@lru_cache(maxsize=None)
def _shipped(name: str) -> Recipe:
    return Recipe.from_file(RECIPES_DIR / f"{name}.toml")


def load_recipe(name_or_file: str | os.PathLike) -> Recipe:
    """A shipped recipe by name (`llama3.1-8b-instruct`), or a TOML file by path."""
    spec = str(name_or_file)
    if spec in shipped_recipes():
        return _shipped(spec)
    if spec.endswith(".toml") or os.path.sep in spec or os.path.isfile(spec):
        return Recipe.from_file(spec)
    raise RecipeError(f"no recipe {spec!r}: give a shipped recipe ({', '.join(shipped_recipes())}) or a .toml file")


REFERENCE = load_recipe("reference")


def recipe_naming(target: str) -> Recipe | None:
    """The shipped recipe whose `targets` names `target` (a name, a hub id, or a folder named like its hub id)."""
    spec = str(target).rstrip("/").lower()
    base = spec.rsplit("/", 1)[-1]
    for name in shipped_recipes():
        recipe = _shipped(name)
        names = {t.lower() for t in recipe.targets}
        if spec in names or base in {t.rsplit("/", 1)[-1] for t in names}:
            return recipe
    return None


# --------------------------------------------------------------------------------------------------
# A target's size without its weights
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TargetShape:
    """What the rule and the plan need of a target, read from its config alone."""

    target: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    parameters: int  # counted on the meta device (no memory, no weights read)
    config: object = field(repr=False, compare=False, default=None)

    @property
    def bf16_weight_bytes(self) -> int:
        return 2 * self.parameters

    @classmethod
    def of(cls, target: str) -> "TargetShape":
        """Read the target's config (a named target's cached conversion, a folder, a GGUF, a hub id's
        config.json) and build its model on the meta device: a family the decoder refuses, or a config transformers
        cannot build, fails here."""
        return cls.from_config(target, target_config(target))

    @classmethod
    def from_config(cls, target: str, config) -> "TargetShape":
        import torch
        from transformers import AutoModelForCausalLM

        from eagle_core.families import check_supported

        check_supported(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        parameters = sum(p.numel() for p in model.parameters())
        return cls(target=str(target), model_type=config.model_type, hidden_size=config.hidden_size,
                   num_hidden_layers=config.num_hidden_layers, vocab_size=config.vocab_size, parameters=parameters,
                   config=config)


def target_config(target: str):
    """A target's transformers config without its weights: a named target or a GGUF file through its cached
    conversion (eagle_core.target), a folder's config.json (a path or any fsspec URL: that file only), or a hub id's
    config.json."""
    import tempfile

    from transformers import AutoConfig

    from eagle_core.target import NAMED_TARGETS, is_remote, materialize_hf_folder

    spec = str(target)
    if spec in NAMED_TARGETS or (spec.endswith(".gguf") and not is_remote(spec)):
        return AutoConfig.from_pretrained(materialize_hf_folder(spec))
    if is_remote(spec):
        import fsspec

        with tempfile.TemporaryDirectory() as tmp:
            try:
                with fsspec.open(spec.rstrip("/") + "/config.json", "rb") as src:
                    Path(tmp, "config.json").write_bytes(src.read())
            except FileNotFoundError as err:
                raise FileNotFoundError(f"target {spec!r} has no config.json") from err
            return AutoConfig.from_pretrained(tmp)
    folder = Path(spec.removeprefix("file://"))
    if (folder / "config.json").is_file():
        return AutoConfig.from_pretrained(folder)
    parts = spec.split("/")
    if len(parts) == 2 and all(parts) and not folder.exists():
        from huggingface_hub import snapshot_download

        return AutoConfig.from_pretrained(snapshot_download(spec, allow_patterns=["config.json"]))
    raise FileNotFoundError(f"target {spec!r} is neither a named target ({', '.join(NAMED_TARGETS)}), a .gguf file, "
                            "a folder with config.json (a path or an fsspec URL) nor a Hugging Face hub id")


def gpus_for_weights(weight_bytes: int, gpu_memory_gib: float = GPU_MEMORY_GIB) -> int:
    """GPUs one target copy needs: its weights take at most WEIGHTS_SHARE of each GPU's memory."""
    if gpu_memory_gib <= 0:
        raise ValueError(f"gpu_memory_gib must be positive, got {gpu_memory_gib}")
    return max(1, math.ceil(weight_bytes / (WEIGHTS_SHARE * gpu_memory_gib * 2**30)))


def derive_recipe(shape: TargetShape, gpu_memory_gib: float = GPU_MEMORY_GIB) -> Recipe:
    """The recipe for a target no shipped recipe names (see RULE)."""
    small = shape.parameters < SMALL_TARGET_PARAMS
    base = load_recipe("smollm2-135m-instruct") if small else REFERENCE
    train_values = "the SmolLM2 recipe's CPU-scale training values" if small else "the reference values"
    vocab = min(REFERENCE.draft_vocab_size, shape.vocab_size)
    return replace(base, name=f"rule ({base.name})",
                   description=f"derived for {shape.target} ({shape.parameters / 1e9:.2f}B parameters, vocabulary "
                               f"{shape.vocab_size})",
                   source=f"{RULE}: {train_values}, draft vocabulary {vocab}", draft_vocab_size=vocab,
                   aux_layer_ids=None, targets=(), path=None,
                   gpus_per_target=gpus_for_weights(shape.bf16_weight_bytes, gpu_memory_gib))


def resolve_recipe(recipe: str | None, target: str | None, shape: TargetShape | None = None,
                   gpu_memory_gib: float = GPU_MEMORY_GIB) -> Recipe:
    """The recipe of a run, with `why` saying how it was chosen: `recipe` (a name or a file) when given; else the
    shipped recipe naming `target`; else the rule applied to the target's shape (read from its config when `shape`
    is None); with no target at all, the reference recipe."""
    if recipe:
        return replace(load_recipe(recipe), why="given by --recipe")
    if target is None:
        return replace(REFERENCE, why="no target given: the reference recipe")
    named = recipe_naming(target)
    if named is not None:
        return replace(named, why=f"the shipped recipe for {target}")
    shape = shape or TargetShape.of(target)
    return replace(derive_recipe(shape, gpu_memory_gib), why=f"by the rule: {RULE}")
