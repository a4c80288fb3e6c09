"""The output of a slim with nothing to slim: the input's files, byte for byte.

When the plan keeps every tensor as it is (:func:`~modelsize.slimming.plan.nothing_to_slim`),
a writer could only rewrite the same tensors in its own framing, which is rarely the input's
(torch's legacy format written as a zip, an ``.npy`` header padded to 64 bytes, a Keras HDF5
laid out again): the output would be no smaller and often larger. This writer copies each file
of the input instead, through the kernel (``copy_file_range``), into the same staged, unnamed
files as any output; verification reads the copy back with modelsize's own reader (the same
tensors, names, dtypes and shapes) and compares the CRC-32 of every file with the input's,
read through the descriptor the copy came from.

It applies to inputs whose files it can name in the output: one file (``-o`` with the input's
extension, or none), or a folder (every file of the checkpoint under it and the folder's other
files, as the directory writer copies them).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from modelsize import formats, inputs
from modelsize.errors import CorruptFileError, VerificationError, printable
from modelsize.inventory import Inventory, StorageRecord
from modelsize.slimming.checksum import crc32
from modelsize.slimming.loadable import problems_loading, refuse_unloadable
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, nothing_to_slim
from modelsize.slimming.writers.base import Meter, Written, slim_name

#: Bytes read at a time for a CRC-32.
_CHUNK = 8 << 20
#: Formats whose loaders refuse two tensors over the same bytes (llama.cpp: every tensor at
#: the end of the previous one): their writer gives each its own bytes, a change worth writing.
_ALIASES_FIXED = frozenset({"gguf"})


def copyable(plan: Plan, out: Path | None) -> bool:
    """Whether slim copies the input as it is: nothing to slim, files it can name, and an
    ``out`` (if given) with the input's extension (another extension asks for its format)."""
    if not nothing_to_slim(plan):
        return False
    inv = plan.inventory
    if plan.aliases and inv.format in _ALIASES_FIXED:
        return False
    if inv.path.is_dir():
        return all(_inside(f.path, inv.path) for f in inv.files)
    if len(inv.files) != 1 or not inv.path.is_file() or not _same_file(inv.files[0].path,
                                                                        inv.path):
        return False
    return out is None or Path(out).suffix == inv.path.suffix


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
    except ValueError:
        return False
    return True


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


@dataclass
class CopyJob:
    """The input's files under the output's names."""

    files: list[str]
    main: str
    directory: bool
    predicted_bytes: int | None
    sources: list[tuple[Path, str]]
    inventory: Inventory
    #: CRC-32 and size of each source as copied, by output name.
    copied: dict[str, tuple[int, int]] = field(default_factory=dict)

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """Each file, copied inside the kernel from one descriptor, which then gives its
        CRC-32 (the bytes copied, not a second opening of the path)."""
        for src, name in self.sources:
            fh = out.open(name)
            fd = inputs.open_fd(src)
            try:
                size = os.fstat(fd).st_size
                _copy(fd, fh, size, meter)
                self.copied[name] = (_crc(fd, size), size)
            finally:
                os.close(fd)
        return {}

    def output_name(self, name: str) -> str:
        """Tensors keep their names."""
        return name

    def verify(self, staged: Path) -> Inventory:
        """The copy read back: every file's CRC-32 and size the input's, the same tensors."""
        base = staged if self.directory else staged.parent
        problems = []
        for name, (crc, size) in self.copied.items():
            fd = os.open(base / name, os.O_RDONLY)
            try:
                got = (_crc(fd, os.fstat(fd).st_size), os.fstat(fd).st_size)
            finally:
                os.close(fd)
            if got != (crc, size):
                problems.append(f"{name} differs from the input")
        from modelsize.slimming.verify import copy_read_back

        # One safetensors file is compared header entry by header entry (no second full
        # inventory of a million tensors).
        streamed = copy_read_back(self.inventory, staged)
        if streamed is not None:
            out, same = streamed
        else:
            out = formats.read(staged)
            # A reader that names tensors after their file (an .npy's array) names the
            # copy's after the copy.
            stems = (("", "") if self.directory
                     else (self.sources[0][0].stem, Path(self.main).stem))

            def layout(inv: Inventory,
                       stem: str) -> list[tuple[str, str, tuple[int, ...], int]]:
                def name(n: str) -> str:
                    return "<file>" + n[len(stem):] if stem and (
                        n == stem or n.startswith(stem + ".")) else n

                return sorted((name(t.name), t.dtype, t.shape, t.nbytes) for t in inv.tensors)

            same = out.format == self.inventory.format and (
                layout(out, stems[1]) == layout(self.inventory, stems[0]))
        if not same:
            problems.append("it reads back with other tensors than the input")
        if not problems:
            self._check_loadable(out)
        if problems:
            raise VerificationError(
                "the copied output failed verification and was not written: "
                + "; ".join(printable(p, 200) for p in problems[:3])
                + " (a modelsize bug: please report it)")
        return out


    def _check_loadable(self, out: Inventory) -> None:
        """The copy is the input, byte for byte: what its framework would refuse in it (the
        loader's rules, an encoded storage that does not decode to its size) is the input's
        fault, refused in one line naming the input, as a rewrite would have refused it."""
        src = self.inventory
        problems = problems_loading(out)
        decode: Callable[[Inventory, StorageRecord], Iterable[bytes]] | None = getattr(
            formats.registry().get(out.format), "storage_chunks", None)
        for st in out.storages if decode is not None and not problems else ():
            if not st.compressed or decode is None:  # (decode is None: never; for mypy)
                continue
            try:
                n = sum(len(chunk) for chunk in decode(out, st))
            except CorruptFileError as exc:
                problems.append(f"{st.key}: {exc.reason}")
                break
            if n != st.logical_nbytes:
                problems.append(f"{st.key} decodes to {n:,} bytes where its header needs "
                                f"{st.logical_nbytes:,}")
                break
        if problems:
            raise CorruptFileError(src.path, src.format,
                                   f"{problems[0]}: its framework would not load it")


def _copy(fd: int, fh: BinaryIO, size: int, meter: Meter) -> None:
    """``size`` bytes of ``fd`` from its start into ``fh``: ``copy_file_range``, or a read and
    write loop where the kernel cannot copy between the two files."""
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(fd, fh.fileno(), min(size - done, 64 << 20), done)
            if n <= 0:
                break
            done += n
            meter.advance(n)
    except OSError:
        pass
    fh.seek(done)
    while done < size:
        chunk = os.pread(fd, min(_CHUNK, size - done), done)
        if not chunk:
            raise OSError(f"input ended at byte {done} of {size}")
        fh.write(chunk)
        done += len(chunk)
        meter.advance(len(chunk))
    fh.flush()


def _crc(fd: int, size: int) -> int:
    buf = bytearray(min(_CHUNK, max(size, 1)))
    view = memoryview(buf)
    crc, pos = 0, 0
    while pos < size:
        n = os.preadv(fd, [view[: min(len(buf), size - pos)]], pos)
        if n <= 0:
            raise OSError(f"file ended at byte {pos} of {size}")
        crc = crc32(view[:n], crc)
        pos += n
    return crc


class CopyWriter:
    """The input as it is (see the module docstring)."""

    name = "copy"

    def default_target(self, plan: Plan, source: Path) -> Path:
        """``x.slim.pt`` for ``x.pt`` (the input's own extension), ``dir.slim`` for a folder."""
        return slim_name(source)

    def prepare(self, plan: Plan, target: Path) -> CopyJob:
        """Every file to copy, under its output name. An input its framework would not load
        is refused: the copy would not load either."""
        inv = plan.inventory
        refuse_unloadable(inv, whole=True)
        if not inv.path.is_dir():
            source = inv.files[0].path
            return CopyJob([target.name], target.name, False, inv.file_bytes,
                           [(source, target.name)], inv)
        root = inv.path
        names = {f.path.relative_to(root).as_posix(): f.path for f in inv.files}
        for p in sorted(root.iterdir()):  # the folder's other files (config, tokenizer...)
            if p.is_file() and p.name not in names:
                names[p.name] = p
        sources = [(p, name) for name, p in names.items()]
        total = sum(p.stat().st_size for p, _ in sources)
        main = inv.files[0].path.relative_to(root).as_posix()
        return CopyJob([n for _, n in sources], main, True, total, sources, inv)
