"""Reading the PNG screenshots Chromium writes (8-bit RGB or RGBA, not interlaced) into numpy,
with zlib and the five PNG row filters: enough for the page tests, without an image library."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_png(path: Path) -> np.ndarray:
    """The image as an array (height, width, channels) of uint8."""
    data = path.read_bytes()
    assert data[:8] == _SIGNATURE, f"{path}: not a PNG"
    position, compressed = 8, []
    width = height = depth = colour = interlace = 0
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position : position + 8])
        body = data[position + 8 : position + 8 + length]
        position += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            compressed.append(body)
    assert depth == 8 and interlace == 0 and colour in (2, 6), (depth, interlace, colour)
    channels = 3 if colour == 2 else 4
    stride = width * channels
    raw = np.frombuffer(zlib.decompress(b"".join(compressed)), np.uint8).reshape(height, 1 + stride)
    image = np.zeros((height, stride), np.uint8)
    prior = np.zeros(stride, np.int64)
    for y in range(height):
        line = raw[y, 1:].astype(np.int64)
        kind = raw[y, 0]
        if kind == 0:
            row = line
        elif kind == 1:  # Sub: each byte adds the one a pixel to its left, a running sum per channel
            row = line.reshape(width, channels).cumsum(axis=0).reshape(-1) & 255
        elif kind == 2:  # Up
            row = (line + prior) & 255
        else:  # Average or Paeth: byte by byte
            row = _sequential(line.tolist(), prior.tolist(), channels, kind == 4)
        image[y] = row
        prior = np.asarray(row, np.int64)
    return image.reshape(height, width, channels)


def _sequential(line: list[int], prior: list[int], channels: int, paeth: bool) -> np.ndarray:
    out = [0] * len(line)
    for i, value in enumerate(line):
        left = out[i - channels] if i >= channels else 0
        up = prior[i]
        if not paeth:
            out[i] = (value + (left + up) // 2) & 255
            continue
        corner = prior[i - channels] if i >= channels else 0
        guess = left + up - corner
        a, b, c = abs(guess - left), abs(guess - up), abs(guess - corner)
        out[i] = (value + (left if a <= b and a <= c else up if b <= c else corner)) & 255
    return np.asarray(out, np.int64)
