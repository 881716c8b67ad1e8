#!/usr/bin/env python3
"""Writes small HDF5 files with h5py, as a user would, for the command-line tests: a good one,
and ones with each kind of problem the reader must name."""
import os
import sys

import h5py
import numpy as np

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(0)


def write(name, **datasets):
    with h5py.File(os.path.join(out, name), "w") as f:
        for key, value in datasets.items():
            f[key] = value


images = rng.integers(0, 255, size=(256, 1, 28, 28), dtype=np.uint8)
labels = rng.integers(0, 10, size=(256,), dtype=np.uint8)
write("good.h5", images=images, labels=labels)
write("no_images.h5", pixels=images, labels=labels)
write("count_mismatch.h5", images=images, labels=labels[:200])
write("wrong_rank.h5", images=images.reshape(256, 28, 28), labels=labels)
write("wrong_shape.h5", images=rng.integers(0, 255, size=(256, 1, 32, 32), dtype=np.uint8), labels=labels)
nan_images = rng.standard_normal(size=(256, 1, 28, 28)).astype(np.float32)
nan_images[5, 0, 3, 3] = np.nan
write("nan.h5", images=nan_images, labels=labels)
