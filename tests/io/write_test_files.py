# Writes the h5py-made files of the io tests, "the obvious way" a user would (numpy arrays,
# default integer types, one gzip-compressed chunked dataset). The values follow the formulas
# of io_test_util.hpp. Usage: /usr/bin/python3 write_test_files.py FOLDER
import sys

import h5py
import numpy as np

folder = sys.argv[1]


def inputs(shape, kind):
    n, per = shape[0], int(np.prod(shape[1:]))
    sample = np.arange(n).reshape(-1, 1)
    element = np.arange(per).reshape(1, -1)
    if kind == "uint8":
        values = ((sample * 37 + element * 11) % 251).astype(np.uint8)
    else:
        values = sample * 1000.0 + element * 0.5  # float64, numpy's default
    return values.reshape(shape)


def labels(n):
    return (np.arange(n) * 7 + 3) % 10  # int64, numpy's default


def targets(n, width):
    return (np.arange(n).reshape(-1, 1) * 10.0 + np.arange(width).reshape(1, -1) + 0.25).astype(np.float32)


with h5py.File(f"{folder}/py_u8.h5", "w") as f:
    f.create_dataset("images", data=inputs((19, 1, 6, 7), "uint8"), chunks=(4, 1, 6, 7), compression="gzip")
    f["labels"] = labels(19).reshape(-1, 1)
with h5py.File(f"{folder}/py_f32.h5", "w") as f:
    f["data"] = inputs((13, 2, 3, 4, 5), "float").astype(np.float32)
    f["targets"] = targets(13, 2)
with h5py.File(f"{folder}/py_f64.h5", "w") as f:
    f["data"] = inputs((11, 1, 4, 4), "float")
    f["labels"] = labels(11).astype(np.uint8)
