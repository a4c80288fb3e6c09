"""What a user should do about an :class:`~modelsize.inventory.Inventory`: findings + explanation.

A finding names a problem, what fixing it saves (``bytes``), a message and the command that fixes
it. The explanation is the paragraph a report opens with: where the bytes went, in one breath.
"""

from __future__ import annotations

import shlex
from enum import Enum
from pathlib import Path
from typing import Any

from modelsize._records import record
from modelsize.categories import Category
from modelsize.dtypes import DTYPES
from modelsize.inventory import Inventory, TensorRecord
from modelsize.report.units import human_bytes, percent


class FindingKind(str, Enum):
    """The closed set of things ``inspect`` can find."""

    UNSAFE_CODE = "unsafe_code"
    OPTIMIZER_STATE = "optimizer_state"
    GRADIENTS = "gradients"
    ACTIVATIONS = "activations"
    UNUSED_STORAGE = "unused_storage"
    DUPLICATES = "duplicates"
    EMA = "ema"
    WIDE_DTYPE = "wide_dtype"
    #: What slim's ONNX graph passes remove that the file's metadata sizes (debug info,
    #: BatchNorm folds): a lower bound.
    GRAPH_PASSES = "graph_passes"
    #: Not a problem: the one command that fixes every finding below it, listed first where
    #: several findings have fixes.
    FIX_ALL = "fix_all"

    def __str__(self) -> str:
        return self.value


@record(frozen=True)
class Finding:
    """One problem: ``bytes`` is what fixing it saves; ``action`` the command that fixes it."""

    kind: FindingKind
    bytes: int
    message: str
    action: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"kind": self.kind.value, "bytes": self.bytes, "message": self.message,
                "action": self.action}


#: Optimizer slot names -> the optimizer that writes them (torch, TF, Keras spellings).
_SLOT_OWNERS: tuple[tuple[frozenset[str], str], ...] = (
    (frozenset({"exp_avg", "exp_avg_sq"}), "Adam"),
    (frozenset({"adam", "adam_1"}), "Adam"),
    (frozenset({"m", "v"}), "Adam"),
    (frozenset({"momentum_buffer"}), "SGD momentum"),
    # Keras's momentum + velocity: Adam, Nadam, Lamb, or RMSprop with momentum: unnamed.
    (frozenset({"momentum", "velocity"}), ""),
    (frozenset({"momentum"}), "momentum"),
    (frozenset({"square_avg"}), "RMSprop"),
    (frozenset({"rmsprop"}), "RMSprop"),
    (frozenset({"sum"}), "Adagrad"),
    (frozenset({"exp_avg", "exp_inf"}), "Adamax"),
)

_GENERIC_NAME = {"step", "state", "param_groups", "lr", "iterations", "iteration", "global_step",
                 "optimizer", "optimizer_state", "optimizer_states", "vars", "learning_rate"}
#: Slot names Keras appends to a variable's name (``dense_kernel_momentum``), longest first.
_KERAS_SLOTS = ("accumulated_delta_var", "accumulated_grad", "average_gradient", "velocity_hat",
                "accumulator", "momentum", "velocity", "linear", "norm")
#: ``_`` + each of :data:`_KERAS_SLOTS`: one ``endswith`` rules them all out.
_KERAS_SUFFIXES = tuple("_" + s for s in _KERAS_SLOTS)
#: Name components that say how a variable is stored, not what it is (TF object-graph keys).
_PLUMBING = {"ATTRIBUTES", "VARIABLE_VALUE", "OBJECT_CONFIG_JSON"}


def _meaningful(part: str) -> bool:
    """Whether a name component can name a slot (not an index, plumbing or private)."""
    return bool(part) and not part.isdigit() and part not in _PLUMBING and not part.startswith("_")


def _slot(t: TensorRecord) -> str:
    """The slot a tensor stands for: last meaningful component of its name."""
    for tag in t.tags:
        if tag.startswith("slot="):
            return tag[5:]
    name = t.name
    if "/" not in name and ":" not in name:  # torch: optimizer.state.0.exp_avg
        last = name.rpartition(".")[2]
        if _meaningful(last) and not last.endswith(_KERAS_SUFFIXES):
            return last
    parts = t.name.split("/")
    if parts[0] == "optimizer_weights" and len(parts) >= 4:
        return parts[2]  # tf.keras: optimizer_weights/Adam/m/dense/kernel:0
    for p in reversed(t.name.replace("/", ".").split(".")):
        p = p.split(":", 1)[0]  # TF variable names end in ":0"
        if _meaningful(p):
            if not p.endswith(_KERAS_SUFFIXES):
                return p
            return next(s for s in _KERAS_SLOTS if p.endswith("_" + s))
    return "state"


#: The last inventory described and its description: ``find`` and ``explain`` both ask.
_DESCRIBED: list[tuple[Inventory, str]] = []


def optimizer_description(inv: Inventory) -> str:
    """``Adam optimizer state (exp_avg, exp_avg_sq)``, from the slots present."""
    if _DESCRIBED and _DESCRIBED[0][0] is inv:
        return _DESCRIBED[0][1]
    tensors = inv.tensors_in(Category.OPTIMIZER_STATE)
    sizes: dict[str, int] = {}
    for t in tensors:
        slot = _slot(t)
        sizes[slot] = sizes.get(slot, 0) + t.stored_nbytes
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])
    big = [s for s, n in ranked if n and s not in _GENERIC_NAME]
    if inv.facts.get("optimizer_slots"):
        # Slots the file stores without names (a Keras 3 archive's optimizer/vars/N): the
        # reader knows them from the optimizer's class.
        big = inv.facts["optimizer_slots"].split(", ")
    name = inv.facts.get("optimizer")
    if not name:
        lowered = {s.lower() for s in sizes}
        for slots, owner in _SLOT_OWNERS:
            if slots <= lowered:
                name = owner or None
                break
    head = f"{name} optimizer state" if name else "optimizer state"
    described = f"{head} ({', '.join(big[:4])})" if big else head
    _DESCRIBED[:] = [(inv, described)]
    return described


def slim_target(path: Path, suffix: str | None = None, tag: str = "slim") -> Path:
    """Where ``modelsize slim`` writes by default: ``x.pt`` -> ``x.slim.pt``; ``suffix``
    replaces the extension (``--to safetensors``); a directory or prefix gets ``.slim``.
    ``tag`` replaces ``slim`` (the fix of one finding among several: ``x.no-optimizer.pt``)."""
    if suffix is None and path.is_file() and path.name.endswith(".weights.h5"):
        # Keras 3's load_weights insists on the .weights.h5 ending.
        return path.with_name(path.name[: -len(".weights.h5")] + f".{tag}.weights.h5")
    ext = path.suffix if (suffix is None and path.is_file()) else ""
    stem = path.name[: -len(ext)] if ext else path.name
    if suffix is not None and path.is_file() and path.suffix:
        stem = path.name[: -len(path.suffix)]
    return path.with_name(f"{stem}.{tag}{suffix if suffix is not None else ext}")


#: The ``modelsize slim`` flags that fix each finding.
SLIM_FLAGS: dict[FindingKind, tuple[str, ...]] = {
    FindingKind.UNSAFE_CODE: ("--to", "safetensors"),
    FindingKind.OPTIMIZER_STATE: ("--drop", "optimizer_state"),
    FindingKind.GRADIENTS: ("--drop", "gradients"),
    FindingKind.ACTIVATIONS: ("--drop", "activations"),
    FindingKind.UNUSED_STORAGE: (),
    FindingKind.DUPLICATES: ("--dedupe",),
    FindingKind.EMA: ("--drop", "ema"),
    FindingKind.WIDE_DTYPE: ("--cast", "float32"),
    FindingKind.GRAPH_PASSES: (),
    FindingKind.FIX_ALL: (),
}

#: What the output of one finding's fix is called when several findings have fixes
#: (``x.no-optimizer.pt``): never the combined fix's ``x.slim.pt``, never each other's.
FIX_TAGS: dict[FindingKind, str] = {
    FindingKind.UNSAFE_CODE: "slim",  # its own extension: x.slim.safetensors
    FindingKind.OPTIMIZER_STATE: "no-optimizer",
    FindingKind.GRADIENTS: "no-gradients",
    FindingKind.ACTIVATIONS: "no-activations",
    FindingKind.UNUSED_STORAGE: "no-unused",
    FindingKind.DUPLICATES: "dedupe",
    FindingKind.EMA: "no-ema",
    FindingKind.WIDE_DTYPE: "float32",
    FindingKind.GRAPH_PASSES: "graph",
}

#: Input formats whose slimmed copy has another format by default, and its extension: slim
#: writes a pickle's arrays as an ``.npz`` archive (it writes no pickles).
OUTPUT_SUFFIX: dict[str, str] = {"pickle": ".npz"}


def _saved_model(inv: Inventory) -> bool:
    return inv.facts.get("layout") == "saved_model"


def _slim(inv: Inventory, *flags: str, tag: str = "slim") -> str:
    path = inv.path
    if _saved_model(inv) and "safetensors" not in flags:
        # A SavedModel's slim keeps what the serving signatures read: optimizer state,
        # Keras' second copies and anything else no signature reads go without flags (which
        # pick tensors, and do not apply to it).
        flags = ()
    suffix = ".safetensors" if "safetensors" in flags else OUTPUT_SUFFIX.get(inv.format)
    target = slim_target(path, suffix, tag)
    url = inv.facts.get("remote_url")  # read from a URL: slim downloads it, OUT goes here
    args = ["modelsize", "slim", url or str(path), *flags, "-o",
            target.name if url else str(target)]
    return shlex.join(args)


def _own_flags(inv: Inventory, kind: FindingKind) -> tuple[str, ...]:
    """The flags that fix ``kind`` alone (the combined fix merges :data:`SLIM_FLAGS`)."""
    if kind == FindingKind.UNUSED_STORAGE and inv.format != "onnx":
        # Without flags slim drops every category inference does not need; ONNX's graph
        # passes (on by default, off with --drop) remove unused initializers themselves.
        return ("--drop", "unused_storage")
    return SLIM_FLAGS[kind]


def find(inv: Inventory) -> list[Finding]:
    """Every finding for an inventory, largest saving first (unsafe code always first).

    Where several findings save bytes, the first entry is the combined fix (kind
    ``fix_all``, its bytes the sum), and each finding's own fix writes an output of its own
    name (``x.no-optimizer.pt``, ``x.no-gradients.pt``), so that every printed command runs
    as printed, in any order."""
    found = _find(inv)
    fixable = _fixable(inv, found)
    if len(fixable) < 2:
        return found
    kinds = {f.kind for f in fixable}
    out: list[Finding] = []
    for f in found:
        if f.kind in kinds:
            tagged = _slim(inv, *_own_flags(inv, f.kind), tag=FIX_TAGS[f.kind])
            f = Finding(f.kind, f.bytes, f.message, tagged)
        out.append(f)
    total = min(sum(f.bytes for f in fixable), inv.file_bytes)
    command = fix_command(inv, found)
    assert command is not None
    combined = Finding(
        FindingKind.FIX_ALL, total, "every finding below at once ("
        + ", ".join(f.kind.value for f in fixable) + ")",
        command,
    )
    return [combined, *out]


def _find(inv: Inventory) -> list[Finding]:
    """Every finding, largest saving first (unsafe code first), each with its own fix."""
    by = inv.bytes_by_category
    out: list[Finding] = []
    if inv.unsafe_globals:
        names = ", ".join(inv.unsafe_globals[:6]) + (" ..." if len(inv.unsafe_globals) > 6 else "")
        out.append(Finding(
            FindingKind.UNSAFE_CODE, 0,
            f"loading this file runs a pickle that imports and calls {names} "
            "(pickle.load, torch.load(weights_only=False), np.load(allow_pickle=True))",
            "never load it with weights_only=False; convert the tensors to safetensors: "
            + _slim(inv, *SLIM_FLAGS[FindingKind.UNSAFE_CODE]),
        ))
    if by[Category.OPTIMIZER_STATE]:
        out.append(Finding(
            FindingKind.OPTIMIZER_STATE, by[Category.OPTIMIZER_STATE],
            f"{human_bytes(by[Category.OPTIMIZER_STATE])} is {optimizer_description(inv)}, "
            "only needed to resume training",
            _slim(inv, *SLIM_FLAGS[FindingKind.OPTIMIZER_STATE]),
        ))
    if by[Category.GRADIENTS]:
        out.append(Finding(
            FindingKind.GRADIENTS, by[Category.GRADIENTS],
            f"{human_bytes(by[Category.GRADIENTS])} is gradients saved with the model; neither "
            "inference nor resuming training needs them",
            _slim(inv, *SLIM_FLAGS[FindingKind.GRADIENTS]),
        ))
    if by[Category.ACTIVATIONS]:
        out.append(Finding(
            FindingKind.ACTIVATIONS, by[Category.ACTIVATIONS],
            f"{human_bytes(by[Category.ACTIVATIONS])} is activations cached by the last forward/"
            "backward pass (outputs, gradInput, attributes of modules); clear them before saving",
            _slim(inv, *SLIM_FLAGS[FindingKind.ACTIVATIONS]),
        ))
    if by[Category.UNUSED_STORAGE]:
        out.append(Finding(
            FindingKind.UNUSED_STORAGE, by[Category.UNUSED_STORAGE],
            f"{human_bytes(by[Category.UNUSED_STORAGE])} of saved storage is reached by no tensor: "
            "a view (slice, narrow, chunk) was saved together with the whole tensor it came from; "
            "save view.clone() instead",
            _slim(inv),
        ))
    if by[Category.DUPLICATES]:
        dups = inv.tensors_in(Category.DUPLICATES)
        pairs = ", ".join(f"{t.name} = {t.duplicate_of}" for t in dups[:3] if t.duplicate_of)
        out.append(Finding(
            FindingKind.DUPLICATES, by[Category.DUPLICATES],
            f"{human_bytes(by[Category.DUPLICATES])} is second copies of identical tensors "
            f"stored separately ({pairs}{', ...' if len(dups) > 3 else ''}); "
            + ("the SavedModel's bundle stores these values twice under two names, as Keras' "
               "model.export does with variables and _all_variables"
               if _saved_model(inv) else "tied weights cloned before saving are the usual cause"),
            _slim(inv, *SLIM_FLAGS[FindingKind.DUPLICATES]),
        ))
    ema = [t for t in inv.tensors if "ema" in t.tags and t.category == Category.WEIGHTS]
    if ema:
        n = sum(t.stored_nbytes for t in ema)
        out.append(Finding(
            FindingKind.EMA, n,
            f"{human_bytes(n)} of the weights is an EMA copy of the model ({len(ema)} tensors); "
            "inference needs one set: keep the EMA weights or the raw ones, not both",
            _slim(inv, *SLIM_FLAGS[FindingKind.EMA]),
        ))
    wide = [t for t in inv.tensors if t.dtype == "float64" and t.stored_nbytes
            and t.category not in (Category.DUPLICATES, Category.UNUSED_STORAGE)]
    if wide:
        n = sum(t.stored_nbytes for t in wide)
        floats = [t for t in inv.tensors if DTYPES.get(t.dtype, DTYPES["int8"]).floating]
        every = len(wide) == len(floats)
        which = ("every floating-point tensor is" if every else
                 f"{len(wide)} tensor is" if len(wide) == 1 else f"{len(wide)} tensors are")
        out.append(Finding(
            FindingKind.WIDE_DTYPE, n // 2,
            f"{which} float64 ({human_bytes(n)}); deep-learning models train and serve in float32 "
            "or narrower, and float32 halves these bytes",
            "export the model again from float32 variables (a SavedModel's graph fixes its "
            "dtypes, so modelsize slim cannot cast it; --to safetensors --cast float32 writes "
            "its tensors alone)" if _saved_model(inv)
            else _slim(inv, *SLIM_FLAGS[FindingKind.WIDE_DTYPE]),
        ))
    graph = _graph_passes(inv)
    if graph is not None:
        out.append(graph)
    first = out[:1] if out and out[0].kind == FindingKind.UNSAFE_CODE else []
    rest = sorted(out[len(first):], key=lambda f: -f.bytes)
    return first + rest


def _fact(inv: Inventory, key: str) -> int:
    value = inv.facts.get(key, "0")
    return int(value) if value.isdigit() else 0


def _graph_passes(inv: Inventory) -> Finding | None:
    """What slim's ONNX graph passes remove at least (sized from the file's metadata by the
    reader: :mod:`modelsize.formats._onnx_savings`)."""
    if inv.format != "onnx":
        return None
    debug = _fact(inv, "onnx.debug_info_bytes")
    folds, folded = _fact(inv, "onnx.batchnorm_folds"), _fact(inv, "onnx.batchnorm_fold_bytes")
    if not debug + folded:
        return None
    parts = []
    if debug:
        parts.append(f"{human_bytes(debug)} of debug info (doc strings and metadata of the "
                     "graph's nodes and values)")
    if folded:
        parts.append(f"{folds} BatchNormalization{'s' if folds > 1 else ''} folded into the "
                     f"Conv or Gemm before {'them' if folds > 1 else 'it'} "
                     f"({human_bytes(folded)})")
    return Finding(
        FindingKind.GRAPH_PASSES, debug + folded,
        f"modelsize slim's graph passes remove at least {human_bytes(debug + folded)}: "
        + " and ".join(parts) + "; they may save more (constant folding, duplicate constants: "
        "modelsize slim --dry-run lists what each pass saves)",
        _slim(inv, *SLIM_FLAGS[FindingKind.GRAPH_PASSES]),
    )


def _graph_may_save(inv: Inventory) -> str | None:
    """For an ONNX model with no finding: what slim's graph passes may still change."""
    if inv.format != "onnx":
        return None
    nodes, ids = _fact(inv, "onnx.constant_nodes"), _fact(inv, "onnx.identity_nodes")
    if not nodes + ids:
        return None
    what = [f"fold {nodes} node{'s' if nodes > 1 else ''} whose inputs are all constants"
            if nodes else "", f"remove {ids} Identity node{'s' if ids > 1 else ''}" if ids else ""]
    return (f"No finding, but modelsize slim's graph passes may "
            f"{' and '.join(w for w in what if w)} (and store equal constants once): "
            f"modelsize slim {shlex.quote(str(inv.path))} --dry-run says what that saves.")


def fix_command(inv: Inventory, findings: list[Finding]) -> str | None:
    """The one ``modelsize slim`` command that fixes every finding that saves bytes."""
    fixable = _fixable(inv, findings)
    if not fixable:
        return None
    flags = [flag for finding in fixable for flag in SLIM_FLAGS[finding.kind]]
    return _slim(inv, *_merge_drops(flags))


def _fixable(inv: Inventory, findings: list[Finding]) -> list[Finding]:
    """The findings that save bytes and that ``modelsize slim`` fixes in place."""
    return [f for f in findings if f.bytes
            and f.kind not in (FindingKind.UNSAFE_CODE, FindingKind.FIX_ALL)
            and not (_saved_model(inv) and f.kind == FindingKind.WIDE_DTYPE)]


def _merge_drops(flags: list[str]) -> list[str]:
    """``--drop a --drop b`` -> ``--drop a,b`` (both spellings work; one reads better)."""
    drops = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--drop"]
    rest: list[str] = []
    skip = False
    for i, f in enumerate(flags):
        if skip:
            skip = False
            continue
        if f == "--drop":
            skip = True
            if drops and i == flags.index("--drop"):
                rest += ["--drop", ",".join(drops)]
            continue
        rest.append(f)
    return rest


_DESCRIBE: dict[Category, str] = {
    Category.BUFFERS: "buffers (BatchNorm running statistics and other non-trainable state)",
    Category.GRADIENTS: "gradients saved with the weights, needed neither for inference nor to "
    "resume",
    Category.ACTIVATIONS: "activations cached by the last forward/backward pass, not needed at all",
    Category.UNUSED_STORAGE: "storage no tensor reaches: a view was saved with the whole tensor "
    "it came from",
    Category.DUPLICATES: "second copies of identical tensors stored separately",
    Category.GRAPH: "model structure",
    Category.METADATA: "headers, names and container structure",
    Category.OTHER: "other data",
}


#: What a format's ``graph`` bytes are (reader name -> description).
_GRAPH_OF: dict[str, str] = {
    "onnx": "the computation graph (nodes, their attributes, the graph's inputs, outputs and "
            "value_info)",
    "keras": "the model's architecture and compile settings (config.json)",
    "keras-h5": "the model's architecture (the model_config attribute)",
    "tensorflow": "the computation graph and its object graph (MetaGraphDef, SavedModel "
                  "functions)",
    "tflite": "the computation graph (operators, tensors and subgraphs of the flatbuffer)",
    "t7": "the Lua module objects around the tensors",
    "gguf": "the model's architecture and tokenizer (key-value metadata)",
    "safetensors": "the model's architecture (config.json)",
    "safetensors-index": "the model's architecture (config.json)",
}


def graph_description(inv: Inventory) -> str:
    """What this file's ``graph`` bytes hold, in its format's terms."""
    what = _GRAPH_OF.get(inv.format)
    if what is not None:
        return f"model structure: {what}"
    if inv.facts.get("torchscript") or inv.facts.get("layout") == "torchscript":
        return "model structure: TorchScript code and the pickled module objects"
    return "model structure: pickled module objects (the classes a load imports and builds)"


def explain(inv: Inventory, findings: list[Finding]) -> str:
    """The paragraph a report opens with: where the bytes went and what to do about it."""
    total = inv.file_bytes
    by = inv.bytes_by_category
    name = inv.path.name or str(inv.path)
    files = f" in {len(inv.files)} files" if len(inv.files) > 1 else ""
    w = by[Category.WEIGHTS]
    sentences = [
        f"{name} is {human_bytes(total)}{files}; the model's weights are "
        f"{human_bytes(w)} ({percent(w, total)})."
    ]
    if total == 0:
        return sentences[0]
    rest = sorted(
        ((c, n) for c, n in by.items() if c != Category.WEIGHTS and n and n * 100 >= total),
        key=lambda cn: -cn[1],
    )
    for cat, n in rest[:4]:
        if cat == Category.OPTIMIZER_STATE:
            what = f"{optimizer_description(inv)}, only needed to resume training"
        elif cat == Category.GRAPH:
            what = graph_description(inv)
        else:
            what = _DESCRIBE[cat]
        sentences.append(f"{human_bytes(n)} ({percent(n, total)}) is {what}.")
    unsafe = [f for f in findings if f.kind == FindingKind.UNSAFE_CODE]
    if unsafe:
        sentences.insert(0, f"Warning: {unsafe[0].message}.")
    fixable = _fixable(inv, findings)
    command = fix_command(inv, findings)
    if fixable and command:
        saved = sum(f.bytes for f in fixable)
        saved = min(saved, total)
        bound = " at least" if any(f.kind == FindingKind.GRAPH_PASSES for f in fixable) else ""
        sentences.append(
            f"Slimming it for inference would save{bound} {human_bytes(saved)} "
            f"({percent(saved, total)}): {command}."
        )
    elif not unsafe:
        sentences.append(_graph_may_save(inv)
                         or "Nothing to slim: every byte is needed to load the model.")
    return " ".join(sentences)
