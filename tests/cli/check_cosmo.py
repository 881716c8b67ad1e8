#!/usr/bin/python3
"""Checks files written by `tessera generate cosmo` (h5py and numpy only).

    check_cosmo.py same A.h5 B.h5 [A2.h5 B2.h5 ...]
                                           every dataset and attribute identical (e.g. 1 vs 3 ranks)
    check_cosmo.py layout FILE --samples N --size S --channels C [--lognormal 0|1] [--split train]
                                           shapes, dtypes, attributes, finite values, targets in [-1, 1]
    check_cosmo.py spectrum FILE           the measured power spectrum of each Gaussian field
                                           (--no-lognormal) has the slope n and the amplitude A of its
                                           parameters

Exits non-zero with a message naming what is wrong.
"""
import argparse
import sys

import h5py
import numpy as np

PARAMETERS = ["sigma", "n", "k_c", "lambda"]


def fail(message):
    sys.exit(f"FAIL: {message}")


def same(a, b):
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        if sorted(fa.keys()) != sorted(fb.keys()):
            fail(f"{a} holds {sorted(fa.keys())}, {b} holds {sorted(fb.keys())}")
        objects = [("/", fa, fb)] + [(name, fa[name], fb[name]) for name in fa.keys()]
        for name, x, y in objects:
            if sorted(x.attrs.keys()) != sorted(y.attrs.keys()):
                fail(f"{name}: attributes differ: {sorted(x.attrs.keys())} vs {sorted(y.attrs.keys())}")
            for key in x.attrs.keys():
                if not np.array_equal(np.asarray(x.attrs[key]), np.asarray(y.attrs[key])):
                    fail(f"{name}: attribute {key} differs: {x.attrs[key]!r} vs {y.attrs[key]!r}")
            if name != "/":
                u, v = x[...], y[...]
                if u.shape != v.shape or u.dtype != v.dtype:
                    fail(f"{name}: {u.shape} {u.dtype} vs {v.shape} {v.dtype}")
                if not np.array_equal(u, v):
                    diff = np.argwhere(u != v)
                    fail(f"{name}: {len(diff)} elements differ, first at {tuple(diff[0])}")
    print(f"OK: {a} and {b} are identical")


def layout(path, samples, size, channels, lognormal, split):
    with h5py.File(path, "r") as f:
        expect = {"data": (samples, channels, size, size, size), "targets": (samples, 4), "parameters": (samples, 4)}
        for name, shape in expect.items():
            if name not in f:
                fail(f"{path}: no dataset '{name}' (holds {list(f.keys())})")
            if f[name].shape != shape or f[name].dtype != np.float32:
                fail(f"{path}: {name} is {f[name].shape} {f[name].dtype}, expected {shape} float32")
            if f[name].chunks is not None:
                fail(f"{path}: {name} is chunked, expected contiguous")
        attrs = f.attrs
        for key, value in {"samples": samples, "size": size, "channels": channels, "lognormal": lognormal}.items():
            if int(attrs[key]) != value:
                fail(f"{path}: attribute {key} = {attrs[key]}, expected {value}")
        if attrs["split"] != split or attrs["generator"] != "tessera generate cosmo":
            fail(f"{path}: split/generator attributes {attrs['split']!r} {attrs['generator']!r}")
        for name in ("targets", "parameters"):
            a = f[name].attrs
            if list(a["names"]) != PARAMETERS:
                fail(f"{path}: {name}.names = {list(a['names'])}")
            if a["low"].shape != (4,) or a["high"].shape != (4,) or not np.all(a["low"] < a["high"]):
                fail(f"{path}: {name} ranges low={a['low']} high={a['high']}")
        growth = f["data"].attrs["growth"]
        if not np.allclose(growth, (np.arange(channels) + 1) / channels):
            fail(f"{path}: growth factors {growth}")
        low, high = f["targets"].attrs["low"], f["targets"].attrs["high"]
        if not np.allclose(low[2:3], [size / 8]) or not np.allclose(high[2:3], [size / 4]):
            fail(f"{path}: k_c range [{low[2]}, {high[2]}], expected [S/8, S/4]")
        targets, parameters = f["targets"][...], f["parameters"][...]
        if not (np.all(np.isfinite(targets)) and np.all(targets >= -1) and np.all(targets <= 1)):
            fail(f"{path}: targets outside [-1, 1]")
        if not np.allclose(targets, 2 * (parameters - low) / (high - low) - 1, atol=1e-5):
            fail(f"{path}: targets are not the normalised parameters")
        if samples >= 4 and np.any(np.ptp(targets, axis=0) < 0.1):
            fail(f"{path}: targets barely vary over the samples: {targets}")
        data = f["data"][...]
        if not np.all(np.isfinite(data)):
            fail(f"{path}: non-finite values in data")
        for i in range(samples):
            x = data[i, channels - 1].astype(np.float64)
            mean, std = x.mean(), x.std()
            sigma = parameters[i, 0]
            if abs(mean) > 0.05 or not 0.3 * sigma < std < 3 * sigma:
                fail(f"{path}: sample {i}: mean {mean:.3g}, std {std:.3g} for sigma {sigma:.3g}")
            skew = ((x - mean) ** 3).mean() / std**3
            if lognormal and skew <= 0:
                fail(f"{path}: sample {i}: a log-normal field with skewness {skew:.3g} <= 0")
            if not lognormal:
                for c in range(channels - 1):  # the same field at growth (c+1)/C
                    if not np.allclose(data[i, c], growth[c] * data[i, channels - 1], rtol=1e-5, atol=1e-6):
                        fail(f"{path}: sample {i}: channel {c} is not {growth[c]} x the last channel")
        if len(set(map(float, data[:, 0, 0, 0, 0]))) < min(samples, 3):
            fail(f"{path}: samples look alike")
    print(f"OK: {path}: {samples} x {channels} x {size}^3, attributes and values as documented")


def spectrum(path):
    """Fits log P(k) exp((k/k_c)^2) = log A + n log k over the shells 2 <= k <= k_c (below the cutoff,
    whose known exponential is divided out), weighted by the modes per shell, and compares the slope
    with n and the intercept with A = sigma^2 / mean over all modes of k^n exp(-(k/k_c)^2)."""
    with h5py.File(path, "r") as f:
        if int(f.attrs["lognormal"]) != 0:
            fail(f"{path}: generate the spectrum check's file with --no-lognormal")
        data, parameters = f["data"][...], f["parameters"][...].astype(np.float64)
    samples, channels, size = data.shape[0], data.shape[1], data.shape[-1]
    k1 = np.fft.fftfreq(size) * size
    kx, ky, kz = np.meshgrid(k1, k1, np.arange(size // 2 + 1), indexing="ij")
    k2 = kx**2 + ky**2 + kz**2
    # Modes of the half (rfft) spectrum stand for themselves and their mirror image, except kz = 0, S/2.
    weight = np.where((kz == 0) | (kz == size // 2), 1.0, 2.0)
    fx, fy, fz = np.meshgrid(k1, k1, k1, indexing="ij")
    full_k2 = fx**2 + fy**2 + fz**2
    shell = np.rint(np.sqrt(k2)).astype(int)
    slope_errors, amplitude_ratios = [], []
    for i in range(samples):
        sigma, n, kc = parameters[i, :3]
        shape = np.where(full_k2 > 0, np.exp(0.5 * n * np.log(np.maximum(full_k2, 1)) - full_k2 / kc**2), 0)
        amplitude = sigma**2 / shape.mean()
        field = data[i, channels - 1].astype(np.float64)  # growth factor 1
        power = np.abs(np.fft.rfftn(field)) ** 2 / field.size * np.exp(k2 / kc**2)
        ks, ps, modes = [], [], []
        for s in range(2, int(kc) + 1):
            m = shell == s
            ks.append(np.log((weight[m] * np.sqrt(k2[m])).sum() / weight[m].sum()))
            ps.append(np.log((weight[m] * power[m]).sum() / weight[m].sum()))
            modes.append(weight[m].sum())
        slope, intercept = np.polyfit(ks, ps, 1, w=np.sqrt(modes))
        slope_errors.append(slope - n)
        amplitude_ratios.append(np.exp(intercept) / amplitude)
        print(f"sample {i}: n = {n:.3f}, measured {slope:.3f}; A = {amplitude:.4g}, measured {np.exp(intercept):.4g}; "
              f"k_c = {kc:.2f}")
    errors, ratios = np.abs(slope_errors), np.array(amplitude_ratios)
    print(f"slope error: mean {errors.mean():.3f}, max {errors.max():.3f}; amplitude ratio {ratios.min():.3f}..{ratios.max():.3f}")
    if errors.max() > 0.3 or errors.mean() > 0.12:
        fail(f"{path}: measured spectral slopes differ from n by up to {errors.max():.3f} (mean {errors.mean():.3f})")
    if ratios.min() < 0.6 or ratios.max() > 1.6 or abs(np.log(ratios).mean()) > 0.15:
        fail(f"{path}: measured amplitudes / A = {ratios}")
    print(f"OK: {path}: power spectra have the slopes and amplitudes of their parameters")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="check", required=True)
    s = sub.add_parser("same")
    s.add_argument("files", nargs="+", help="pairs of files")
    l = sub.add_parser("layout")
    l.add_argument("file")
    l.add_argument("--samples", type=int, required=True)
    l.add_argument("--size", type=int, required=True)
    l.add_argument("--channels", type=int, default=1)
    l.add_argument("--lognormal", type=int, default=1)
    l.add_argument("--split", default="train")
    p = sub.add_parser("spectrum")
    p.add_argument("file")
    args = parser.parse_args()
    if args.check == "same":
        if len(args.files) % 2 != 0:
            parser.error("same: give pairs of files")
        for a, b in zip(args.files[0::2], args.files[1::2]):
            same(a, b)
    elif args.check == "layout":
        layout(args.file, args.samples, args.size, args.channels, args.lognormal, args.split)
    else:
        spectrum(args.file)


if __name__ == "__main__":
    main()
