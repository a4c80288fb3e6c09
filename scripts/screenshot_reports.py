"""Open modelsize's HTML reports in a real headless browser and take screenshots.

Builds the demo's files, writes the ``--html`` report of ``inspect``, ``diff``, ``slim`` and
``estimate`` for them, and has headless Chromium (the system's ``chromium-headless-shell`` or
``chromium``: ``apt-get install chromium-headless-shell``) load each page with the network
switched off and save a PNG. Prints one line per page: its size, the PNG's size and how many
distinct colours it has (a blank or broken page has one or two).

    .venv/bin/python scripts/screenshot_reports.py [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def browser() -> str | None:
    """The first headless-capable Chromium on PATH (or in /usr/lib/chromium), or None."""
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    for path in ("/usr/lib/chromium/chromium-headless-shell", "/usr/lib/chromium/chromium"):
        if Path(path).exists():
            return path
    return None


def screenshot(html: Path, png: Path, width: int = 1200, height: int = 1600) -> None:
    """Load ``html`` in headless Chromium with no network and write ``png``."""
    exe = browser()
    if exe is None:
        raise RuntimeError("no Chromium found (apt-get install chromium-headless-shell)")
    with tempfile.TemporaryDirectory() as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={width},{height}",
               "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
               f"--screenshot={png}", html.resolve().as_uri()]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)


def png_colors(png: Path, limit: int = 4096) -> int:
    """Distinct RGB(A) colours in an 8-bit truecolour PNG (counted up to ``limit``)."""
    data = png.read_bytes()
    pos, idat, width, height, ctype = 8, b"", 0, 0, 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, _depth, ctype = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = {2: 3, 6: 4}.get(ctype)
    if bpp is None:
        return -1
    raw = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    colors: set[bytes] = set()
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line
        if y % 4 == 0:
            for x in range(0, stride, bpp * 4):
                colors.add(bytes(line[x:x + 3]))
            if len(colors) >= limit:
                break
    return len(colors)


def build_pages(out: Path) -> list[Path]:
    """The demo's files and one HTML report per verb, in ``out``."""
    import torch

    from modelsize.cli import main
    from modelsize.cli.demo import inspect_section, seed_cnn

    files = out / "files"
    files.mkdir(parents=True, exist_ok=True)
    inspect_section(files)
    pages = {"inspect": ["inspect", str(files / "train.pt")],
             "diff": ["diff", str(files / "train.pt"), str(files / "train.slim.pt")]}
    made = []
    for name, argv in pages.items():
        path = out / f"{name}.html"
        if main([*argv, "--html", str(path)]) not in (0,):
            raise RuntimeError(f"modelsize {name} failed")
        made.append(path)
    import modelsize
    from modelsize.report import html

    slimmed = modelsize.slim(files / "train.pt", files / "t2.pt", force=True)
    path = out / "slim.html"
    html.write(str(path), html.render_slim(slimmed))
    made.append(path)
    est = modelsize.estimate(seed_cnn(), (torch.randn(64, 1, 28, 28),), mode="train")
    path = out / "estimate.html"
    html.write(str(path), html.render_estimate(est))
    made.append(path)
    return made


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="keep pages and screenshots here")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="modelsize-html-"))
    out.mkdir(parents=True, exist_ok=True)
    for page in build_pages(out):
        png = page.with_suffix(".png")
        screenshot(page, png)
        print(f"{page.name}: {page.stat().st_size:,} bytes of HTML -> {png} "
              f"({png.stat().st_size:,} bytes, {png_colors(png)} colours)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
