"""DeepSpeed checkpoint directories (``engine.save_checkpoint(DIR)``).

Layout::

    DIR/latest                                   the tag of the newest checkpoint ("global_step1")
    DIR/global_step1/mp_rank_00_model_states.pt  per model-parallel rank: ``module`` (the state
                                                 dict), ``optimizer`` (None under ZeRO), shapes,
                                                 ``ds_config``, ``ds_version``
    DIR/global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt
                                                 per data-parallel rank under ZeRO:
                                                 ``optimizer_state_dict`` with the base
                                                 optimizer's state and the rank's flat fp32
                                                 partition (``single_partition_of_fp32_groups``,
                                                 ``fp32_flat_groups`` under ZeRO-3)
    bf16_zero_pp_rank_*_optim_states.pt          the same for the bf16 optimizer
    zero_pp_rank_*_mp_rank_*_model_states.pt     ZeRO-3: module tensors are empty placeholders

Every ``.pt`` is read by the single-file PyTorch readers and merged
(:func:`~modelsize.formats.torch_sharded.merge`). Optimizer files hold optimizer state only:
the fp32 master weights of mixed precision and ZeRO are copies kept for the optimizer, not the
model's weights. In model files, tensors under ``optimizer`` (the non-ZeRO optimizer's state
with its fp32 groups) and ``lr_scheduler`` are optimizer state too. Facts give the ZeRO layout
read from the file names and the bytes of each rank.
"""

from __future__ import annotations

import re
from pathlib import Path

from modelsize._records import record
from modelsize.categories import Category
from modelsize.errors import CorruptFileError, printable
from modelsize.formats import _zip
from modelsize.formats._pickle import PickleError, scan
from modelsize.formats.base import Source, real_path
from modelsize.formats.torch_sharded import (
    Merged,
    Part,
    SideFile,
    inside,
    left_out_note,
    merge,
    read_torch_file,
    relative,
    split_facts,
)
from modelsize.inventory import Inventory, InventoryBuilder, TensorRecord

FORMAT = "deepspeed"
LATEST = "latest"
#: The ``latest`` file holds one tag; anything longer is not DeepSpeed's.
MAX_LATEST = 4096
_STATES = re.compile(
    r"^(?P<bf16>bf16_)?(?:zero_pp_rank_(?P<dp>\d+)_|expp_rank_(?P<ep>\d+)_)?"
    r"(?P<other>[\w-]*?)mp_rank_(?P<mp>\d+)_?(?P<role>model|optim)_states\.pt$"
)
_LAYER = re.compile(r"^(?P<other>layer_\d+)-model_states\.pt$")
_STEP = re.compile(r"(\d+)$")
#: DeepSpeed classes its checkpoints pickle: an int enum, a dataclass and the loss scaler,
#: rebuilt from plain values. Loading still needs DeepSpeed installed (a fact says so).
DEEPSPEED_GLOBALS: frozenset[str] = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)
_MODEL_OPTIMIZER_KEYS = ("optimizer.", "lr_scheduler.")


@record(frozen=True)
class StatesFile:
    """One ``*_states.pt`` file and what its name says about it."""

    path: Path
    role: str  # "model" or "optim"
    dp_rank: int | None
    mp_rank: int
    bf16: bool
    other: str = ""  # pipeline layer or expert part of the name

    @property
    def label(self) -> str:
        """A short name for the file's tensors: ``mp0.model``, ``rank1.optim``."""
        parts = [self.other.strip("_-")] if self.other else []
        if self.dp_rank is not None:
            parts.append(f"rank{self.dp_rank}")
        if self.mp_rank or self.dp_rank is None:
            parts.append(f"mp{self.mp_rank}")
        return ".".join([*parts, self.role])


def parse_name(path: Path) -> StatesFile | None:
    """The role and ranks a DeepSpeed file name encodes, or None if it is not one."""
    layer = _LAYER.match(path.name)
    if layer is not None:
        return StatesFile(path, "model", None, 0, False, layer["other"])
    m = _STATES.match(path.name)
    if m is None:
        return None
    other = m["other"] if m["ep"] is None else f"expp{m['ep']}"
    return StatesFile(path, m["role"], None if m["dp"] is None else int(m["dp"]), int(m["mp"]),
                      m["bf16"] is not None, other)


def states_files(inv: Inventory) -> list[StatesFile]:
    """The states files of a DeepSpeed inventory (its ``latest`` file left out), in its order."""
    found = (parse_name(f.path) for f in inv.files)
    return [f for f in found if f is not None]


def states_tree(path: Path) -> object:
    """The object a states file pickles, parsed and never loaded: for what only its plain data
    says (``param_shapes``, ``buffer_names``, ``partition_count``...). Tensors stay
    placeholders."""
    builder = InventoryBuilder(FORMAT, [path])
    pkl = next((m for m in _zip.members(path, builder)
                if m.name.endswith("data.pkl") and m.name.count("/") <= 1), None)
    if pkl is None:
        raise builder.corrupt("expected a torch.save zip archive with a data.pkl member")
    data = _zip.read_member(path, pkl, builder)
    try:
        return scan(data).value
    except PickleError as exc:
        raise builder.corrupt(f"{pkl.name} is not a valid pickle: {exc}") from exc


def _states_files(directory: Path) -> list[StatesFile]:
    found = (parse_name(p) for p in sorted(directory.iterdir()) if p.is_file())
    return [f for f in found if f is not None]


def _step(name: str) -> int:
    m = _STEP.search(name)
    return int(m.group(1)) if m else -1


def _tag_dirs(root: Path) -> list[Path]:
    return sorted((p for p in root.iterdir() if p.is_dir() and _states_files(p)),
                  key=lambda p: (_step(p.name), p.name))


def _model_recategorize(t: TensorRecord) -> Category | None:
    return Category.OPTIMIZER_STATE if t.name.startswith(_MODEL_OPTIMIZER_KEYS) else None


def _optim_recategorize(t: TensorRecord) -> Category | None:
    return Category.OPTIMIZER_STATE


def _full_weights(files: list[StatesFile]) -> str:
    """Where the model's full weights are (what ``modelsize slim`` consolidates)."""
    if any(f.role == "optim" and f.dp_rank is not None for f in files):
        return ("fp32 master weights, gathered from the ranks' optimizer partitions (as "
                "DeepSpeed's zero_to_fp32.py does)")
    return "the module's weights in the model states file, as saved"


def _zero_layout(files: list[StatesFile]) -> str:
    if any(f.role == "model" and f.dp_rank is not None for f in files):
        return "ZeRO stage 3: parameters, gradients and optimizer states partitioned"
    optim = [f for f in files if f.role == "optim"]
    if optim and all(f.bf16 for f in optim):
        return "bf16 optimizer: fp32 master weights and optimizer states partitioned"
    if optim:
        return "ZeRO stage 1 or 2: optimizer states partitioned"
    return "no ZeRO: optimizer state saved with the model"


class _DeepSpeedRead:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.spec = Merged(FORMAT, root)

    def locate(self) -> tuple[Path, Path | None]:
        """The tag directory to read and the ``latest`` file pointing at it (if any)."""
        root, latest = self.root, self.root / LATEST
        if latest.is_file():
            size = latest.stat().st_size
            raw = latest.read_bytes()[: MAX_LATEST + 1]
            tag = raw.decode("utf-8", "replace").strip()
            if size > MAX_LATEST or not tag or "\n" in tag:
                raise CorruptFileError(latest, FORMAT,
                                       f"expected one checkpoint tag, found {size} bytes")
            tag_dir = inside(root, tag, latest, FORMAT, "tag")
            if not tag_dir.is_dir():
                raise CorruptFileError(
                    latest, FORMAT,
                    f"names tag {printable(tag)!r} but {printable(str(tag_dir))} is missing",
                )
            return tag_dir, latest
        if _states_files(root):
            return root, None
        tags = _tag_dirs(root)
        if not tags:
            raise CorruptFileError(root, FORMAT, "no 'latest' file and no directory of "
                                                 "*_model_states.pt / *_optim_states.pt files")
        self.spec.notes.append(f"no 'latest' file: reading {printable(tags[-1].name)}, the "
                               "highest step")
        return tags[-1], None

    def run(self) -> Inventory:
        tag_dir, latest = self.locate()
        files = _states_files(tag_dir)
        if not any(f.role == "model" for f in files):
            raise CorruptFileError(tag_dir, FORMAT, "expected DeepSpeed's *_model_states.pt "
                                                    "files, found none")
        parts = []
        for f in files:
            is_model = f.role == "model"
            parts.append(Part(
                read_torch_file(f.path), relative(f.path, self.root), name_prefix=f"{f.label}:",
                recategorize=_model_recategorize if is_model else _optim_recategorize,
                allowed_globals=DEEPSPEED_GLOBALS,
            ))
        if latest is not None:
            self.spec.side_files.append(SideFile(latest, Category.METADATA, "latest tag"))
        self.describe(files, parts, tag_dir)
        counted = {real_path(f.path) for f in files}
        if latest is not None:
            counted.add(real_path(latest))
        others = [p for d in {self.root, tag_dir} for p in d.iterdir()
                  if p.is_file() and real_path(p) not in counted]
        note = left_out_note(self.root, others)
        if note:
            self.spec.notes.append(note)
        older = [p.name for p in _tag_dirs(self.root) if real_path(p) != real_path(tag_dir)]
        if older and tag_dir != self.root:
            self.spec.notes.append(
                f"{len(older)} other checkpoint tag(s) beside it were not counted: "
                + ", ".join(printable(n, 60) for n in older[:5])
            )
        inv = merge(self.spec, parts)
        groups: dict[str, list[int]] = {}
        for i, f in enumerate(files):
            rank = f"mp rank {f.mp_rank}" if f.dp_rank is None else f"rank {f.dp_rank}"
            if f.dp_rank is not None and f.mp_rank:
                rank += f" mp {f.mp_rank}"
            groups.setdefault(f"{rank} {'model' if f.role == 'model' else 'optimizer'} states",
                              []).append(i)
        inv.facts.update(split_facts(inv, groups))
        return inv

    def describe(self, files: list[StatesFile], parts: list[Part], tag_dir: Path) -> None:
        facts = self.spec.facts
        facts["tag"] = tag_dir.name
        facts["zero"] = _zero_layout(files)
        facts["full_weights"] = _full_weights(files)
        facts["model_states_bytes"] = str(sum(p.inventory.file_bytes for f, p in
                                              zip(files, parts, strict=True) if f.role == "model"))
        facts["optimizer_states_bytes"] = str(sum(p.inventory.file_bytes for f, p in
                                                  zip(files, parts, strict=True)
                                                  if f.role == "optim"))
        needs = sorted({g.rsplit(".", 1)[-1] for p in parts for g in p.inventory.unsafe_globals
                        if g in DEEPSPEED_GLOBALS})
        if needs:
            facts["unpickling_needs"] = "deepspeed (" + ", ".join(needs) + ")"
        if any(f.role == "model" and f.dp_rank is not None for f in files):
            self.spec.notes.append(
                "ZeRO-3 model files hold empty placeholders: the weights exist only as fp32 "
                "partitions in the optimizer files (DeepSpeed's zero_to_fp32.py gathers them)"
            )


class DeepSpeedReader:
    """DeepSpeed checkpoint directories: a ``latest`` tag file, or a tag directory itself."""

    name = FORMAT
    extensions: tuple[str, ...] = ()

    def sniff(self, source: Source) -> bool:
        """A directory with ``latest``, or holding (or whose subdirectories hold) states files."""
        if source.kind != "dir":
            return False
        d = source.path
        if (d / LATEST).is_file():
            return True
        files = _states_files(d)
        if files:
            return any(f.role == "optim" for f in files) or any(
                f.path.name.startswith("mp_rank_") for f in files)
        return bool(_tag_dirs(d))

    def read(self, source: Source) -> Inventory:
        """One inventory over the tag's files (and the ``latest`` file that names it)."""
        return _DeepSpeedRead(source.path).run()
