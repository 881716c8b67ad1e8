#!/usr/bin/env python3
"""ONNX import and export against Debian's PyTorch 1.13 as the numerical oracle.

Run with /usr/bin/python3 (python3-torch, python3-onnx, python3-h5py, python3-yaml). Networks are
built in PyTorch with every module a top-level attribute (so a PyTorch parameter `conv1.weight`
is Tessera's `conv1.weight`; batch norm's `weight`/`bias` are Tessera's `gamma`/`beta`), exported
with `torch.onnx.export(..., training=TRAINING, do_constant_folding=False, opset_version=13)` (batch
norm and dropout stay in the graph) and imported with `tessera import onnx`.

Cases (every subprocess under a timeout; every check prints FAIL and the test exits 1 at the end;
the largest relative errors are printed also on success). A relative error is max|a - b| / max|b|
over a tensor (|a - b| / |b| for a loss), b PyTorch's float32 value in train mode.

  fashion    the Fashion-MNIST CNN (conv 1->32, relu, maxpool, conv 32->64, relu, maxpool,
             flatten, linear 3136->128, relu, linear ->10), softmax cross-entropy, batch 8.
  residual   a residual CNN: batch norm, leaky ReLU (0.1), a residual add, a channel concat of two
             convolution branches, max and average pools, x.view(N, -1), a linear head; batch 8.
             Also: a network with nn.Dropout(0.25) imports as `type: dropout, rate: 0.25` (its
             masks cannot match PyTorch's, so it is not trained here).
  cosmo3d    a CosmoFlow-style 3-D regression network (conv3d 4->8, leaky ReLU, maxpool3d, conv3d
             8->16, leaky ReLU, maxpool3d, flatten, linear ->32, leaky ReLU, linear ->4), MSE
             (`--loss mse`), input [4, 16, 16, 16], batch 4.

             For each of the three: the imported model file has the expected layers and the weights
             file holds PyTorch's weights and batch-norm statistics bit for bit; then
             tessera_onnx_oracle runs 3 plain SGD steps on one batch at 1 rank and under spatial,
             filter (model-parallel) and mixed plans at 2-4 ranks (the plans are written from the
             imported model.yaml's layer names), and the loss of every step, every parameter's
             gradient at step 0 (each non-zero) and every parameter after 3 steps equal PyTorch's
             within 1e-5; `tessera train --init` for 3 steps at 1 rank ends with PyTorch's
             parameters (and batch-norm running statistics) within 1e-5.

  export     the fashion and residual networks are imported and trained 3 steps by `tessera train
             --init`; `tessera export onnx` of the final checkpoint (and of a dropout network's
             weights file) passes onnx.checker (full check), has the promised structure (input
             `input` with a symbolic batch, one output, opset 13, PyTorch's initializer names,
             nodes named after the layers, only the promised operators), and, run by a small ONNX
             interpreter written here on torch.nn.functional, gives the outputs of the PyTorch
             module holding the checkpoint's weights in eval mode within 1e-5. Round trip: for all
             four networks, import -> export -> import gives the same model.yaml text and bitwise
             equal param/* and buffer/* datasets.

  bad-input  a truncated .onnx, random bytes, an empty file, a missing file, an unsupported
             operator (Sigmoid), a grouped convolution, a Gemm whose weight does not fit the
             flattened features: exit 2, one `tessera: error` message naming the problem, and the
             output folder holds nothing afterwards.
"""
import argparse
import copy
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import warnings

import h5py
import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from onnx import TensorProto, helper, numpy_helper

CASES = ["fashion", "residual", "cosmo3d", "export", "bad-input"]
parser = argparse.ArgumentParser()
parser.add_argument("--tessera", required=True)
parser.add_argument("--oracle", required=True, help="tessera_onnx_oracle")
parser.add_argument("--mpirun", required=True, help="the mpirun command line, without -n")
parser.add_argument("--work", required=True)
parser.add_argument("--case", action="append", choices=CASES)
args = parser.parse_args()
cases = args.case or CASES

TOL = 1e-5
UPDATE_TOL = 2e-4  # on (final - initial) parameters (float32 cancellation: ~1e-5 seen), see compare_oracle
LR = 0.05
STEPS = 3
TIMEOUT_S = 300
OPSET = 13

warnings.filterwarnings("ignore")  # torch.onnx's notes on batch norm's num_batches_tracked
torch.set_num_threads(1)
shutil.rmtree(args.work, ignore_errors=True)
os.makedirs(args.work)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from checks import check, exit_if_failed  # noqa: E402


def run(command, name, timeout=TIMEOUT_S):
    """Runs a command; returns the CompletedProcess, or None when it timed out."""
    print("$", shlex.join(command), flush=True)
    start = time.monotonic()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        check(False, f"{name}: timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}")
        return None
    print(f"  ({time.monotonic() - start:.1f} s, exit {result.returncode})", flush=True)
    return result


def run_ok(command, name, timeout=TIMEOUT_S):
    result = run(command, name, timeout)
    if result is None:
        return False
    return check(result.returncode == 0, f"{name}: exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\n"
                                         f"stderr:\n{result.stderr[-3000:]}")


def mpirun(ranks):
    return shlex.split(args.mpirun) + ["-n", str(ranks)]


def rel_error(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    scale = np.max(np.abs(b)) if b.size else 0.0
    diff = np.max(np.abs(a - b)) if b.size else 0.0
    return float(diff / scale) if scale > 0 else float(diff)


# --- networks (every module a top-level attribute: Tessera's layer names are the attributes) ------

class FashionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc2(self.relu3(self.fc1(x)))


class ResidualNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(8)
        self.stem_act = nn.LeakyReLU(0.1)
        self.block_conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.block_bn1 = nn.BatchNorm2d(8)
        self.block_act1 = nn.LeakyReLU(0.1)
        self.block_conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.res_act = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.branch_a = nn.Conv2d(8, 8, 3, padding=1)
        self.branch_b = nn.Conv2d(8, 4, 1)
        self.pool2 = nn.AvgPool2d(2)
        self.fc1 = nn.Linear(12 * 4 * 4, 32)
        self.fc_act = nn.LeakyReLU(0.1)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        s = self.stem_act(self.stem_bn(self.stem(x)))
        y = self.block_conv2(self.block_act1(self.block_bn1(self.block_conv1(s))))
        x = self.pool1(self.res_act(y + s))
        x = torch.cat([self.branch_a(x), self.branch_b(x)], 1)
        x = self.pool2(x)
        x = x.view(x.size(0), -1)
        return self.fc2(self.fc_act(self.fc1(x)))


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x):
        x = torch.flatten(self.pool(self.act(self.conv1(x))), 1)
        return self.fc(self.drop(x))


class Cosmo3dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv3d(4, 8, 3, padding=1)
        self.act1 = nn.LeakyReLU(0.1)
        self.pool1 = nn.MaxPool3d(2)
        self.conv2 = nn.Conv3d(8, 16, 3, padding=1)
        self.act2 = nn.LeakyReLU(0.1)
        self.pool2 = nn.MaxPool3d(2)
        self.fc1 = nn.Linear(16 * 4 * 4 * 4, 32)
        self.act3 = nn.LeakyReLU(0.1)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        x = self.pool1(self.act1(self.conv1(x)))
        x = self.pool2(self.act2(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc2(self.act3(self.fc1(x)))


def randomize_batch_norm(model, generator):
    """Batch norm's affine parameters and running statistics away from 1/0, so that mixing up
    gamma and beta or mean and variance shows."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d) or isinstance(module, nn.BatchNorm3d):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=generator))
                module.bias.copy_(0.2 * torch.randn(module.bias.shape, generator=generator))
                module.running_mean.copy_(0.3 * torch.randn(module.running_mean.shape, generator=generator))
                module.running_var.copy_(0.5 + torch.rand(module.running_var.shape, generator=generator))


def make_problem(name):
    """(model, inputs, targets for PyTorch, targets as float32 for Tessera, loss, import flags)."""
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(99)
    if name == "fashion":
        model = FashionNet()
        x = torch.rand(8, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        return model, x, y, y.numpy().astype(np.float32), nn.CrossEntropyLoss(), []
    if name == "residual":
        model = ResidualNet()
        randomize_batch_norm(model, g)
        x = torch.randn(8, 3, 16, 16, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        return model, x, y, y.numpy().astype(np.float32), nn.CrossEntropyLoss(), []
    if name == "dropout":
        model = DropoutNet()
        x = torch.rand(4, 1, 8, 8, generator=g)
        y = torch.randint(0, 10, (4,), generator=g)
        return model, x, y, y.numpy().astype(np.float32), nn.CrossEntropyLoss(), []
    if name == "cosmo3d":
        model = Cosmo3dNet()
        x = torch.randn(4, 4, 16, 16, 16, generator=g)
        y = torch.randn(4, 4, generator=g)
        return model, x, y, y.numpy().astype(np.float32), nn.MSELoss(), ["--loss", "mse"]
    raise ValueError(name)


def export_onnx(model, example, path):
    """torch.onnx.export in training mode. The export runs the model (in train mode batch norm then
    updates its running statistics), so it works on a copy; what the file holds is read back by
    load_onnx_state."""
    copy_ = copy.deepcopy(model)
    copy_.train()
    torch.onnx.export(copy_, example, path, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, opset_version=OPSET)


def load_onnx_state(model, path):
    """Sets the module's parameters and buffers to the .onnx file's initializers (PyTorch's names)."""
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(path).graph.initializer}
    state = model.state_dict()
    with torch.no_grad():
        for key, value in state.items():
            if key.endswith("num_batches_tracked"):
                continue
            if check(key in inits, f"{path}: no initializer '{key}'"):
                value.copy_(torch.from_numpy(np.array(inits[key])))


def batch_norm_layers(model):
    return {name for name, m in model.named_modules() if isinstance(m, (nn.BatchNorm2d, nn.BatchNorm3d))}


def tessera_names(model):
    """{PyTorch state name: Tessera weights-file dataset} for parameters and batch-norm buffers."""
    bn = batch_norm_layers(model)
    out = {}
    for key in model.state_dict():
        layer, _, field = key.rpartition(".")
        tlayer = layer.replace(".", "_")
        if layer in bn:
            field_map = {"weight": "param/{}.gamma", "bias": "param/{}.beta", "running_mean": "buffer/{}.0",
                         "running_var": "buffer/{}.1"}
            if field in field_map:
                out[key] = field_map[field].format(tlayer)
        else:
            out[key] = f"param/{tlayer}.{field}"
    return out


def pytorch_reference(model, x, y, loss_fn, steps=STEPS, lr=LR):
    """Plain SGD on one batch in train mode: each step's loss, the first gradients, the final state."""
    m = copy.deepcopy(model)
    m.train()
    optimizer = torch.optim.SGD(m.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(m(x), y)
        loss.backward()
        losses.append(float(loss.item()))
        if step == 0:
            grads = {n: p.grad.detach().numpy().copy() for n, p in m.named_parameters()}
        optimizer.step()
    state = {k: v.detach().numpy().copy() for k, v in m.state_dict().items() if not k.endswith("num_batches_tracked")}
    return {"losses": losses, "grads": grads, "state": state}


# --- Tessera files ---------------------------------------------------------------------------------

def read_model(directory):
    with open(os.path.join(directory, "model.yaml")) as f:
        return yaml.safe_load(f)


def layer_inputs(model):
    """{layer: [its input layers]} ('input' for the model's input)."""
    out, previous = {}, "input"
    for layer in model["layers"]:
        inputs = layer.get("inputs", previous)
        out[layer["name"]] = [inputs] if isinstance(inputs, str) else list(inputs)
        previous = layer["name"]
    return out


def read_h5(path, prefixes=("param/", "buffer/")):
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, item):
            if isinstance(item, h5py.Dataset) and name.startswith(prefixes):
                out[name] = item[()]
        f.visititems(visit)
    return out


def import_model(onnx_path, directory, flags=()):
    shutil.rmtree(directory, ignore_errors=True)
    return run_ok([args.tessera, "import", "onnx", onnx_path, "-o", directory, *flags], f"import {onnx_path}")


def check_import(name, model, directory, expected_layers):
    """The model file's layers and the weights file's tensors (bitwise PyTorch's)."""
    m = read_model(directory)
    layers = [(layer["name"], layer["type"]) for layer in m["layers"]]
    check(layers == expected_layers, f"{name}: imported layers {layers}, expected {expected_layers}")
    weights = read_h5(os.path.join(directory, "weights.h5"))
    names = tessera_names(model)
    check(set(weights) == set(names.values()),
          f"{name}: weights.h5 holds {sorted(weights)}, expected {sorted(names.values())}")
    for key, value in model.state_dict().items():
        if key in names and names[key] in weights:
            got = weights[names[key]]
            check(got.dtype == np.float32, f"{name}: {names[key]} is {got.dtype}, not float32")
            check(got.shape == tuple(value.shape) and np.array_equal(got, value.numpy()),
                  f"{name}: {names[key]} (shape {got.shape}) differs from PyTorch's {key} (shape {tuple(value.shape)})")
    return m


# --- plans (written from the imported model file's layer names and types) ------------------------

SPATIAL_TYPES = {"conv", "relu", "leaky_relu", "maxpool", "avgpool", "batchnorm", "add", "concat", "dropout"}
FILTER_FOLLOWERS = {"relu", "leaky_relu", "batchnorm", "maxpool", "avgpool", "dropout"}


def plan_text(ranks, layers, comment):
    lines = [f"# {comment}", f"ranks: {ranks}", f"default: {{sample: {ranks}}}", "layers:"]
    for name, split in layers.items():
        parts = []
        for key, value in split.items():
            parts.append(f"{key}: [{', '.join(map(str, value))}]" if isinstance(value, list) else f"{key}: {value}")
        lines.append(f"  {name}: {{{', '.join(parts)}}}")
    return "\n".join(lines) + "\n"


def spatial_plan(model, ranks, stages, sample=1):
    """Every layer before the first flatten/linear split spatially: stages[k] after k pools."""
    layers, pools = {}, 0
    for layer in model["layers"]:
        if layer["type"] not in SPATIAL_TYPES:
            break
        split = stages[min(pools, len(stages) - 1)]
        layers[layer["name"]] = {"sample": sample, "spatial": list(split)}
        if layer["type"] in ("maxpool", "avgpool"):
            pools += 1
    return ranks, layers, f"spatial: sample {sample} x {stages}"


def filter_plan(model, ranks, sample=1):
    """Model parallel: conv and linear by filter, or by channel where their input is split by
    filter; batch norm, activations and pools after a filter split keep it; the output layer and
    add/concat/flatten by sample."""
    parts = ranks // sample
    inputs = layer_inputs(model)
    layers = {}
    last = model["layers"][-1]["name"]
    for layer in model["layers"]:
        name, kind = layer["name"], layer["type"]
        if name == last:
            break
        source = inputs[name]
        source_filter = len(source) == 1 and "filter" in layers.get(source[0], {})
        if kind in ("conv", "linear"):
            layers[name] = {"sample": sample, "channel" if source_filter else "filter": parts}
        elif kind in FILTER_FOLLOWERS and source_filter:
            layers[name] = {"sample": sample, "filter": parts}
    return ranks, layers, f"model parallel: sample {sample} x filter/channel {parts}"


def write_plan(directory, tag, plan):
    ranks, layers, comment = plan
    path = os.path.join(directory, f"plan_{tag}.yaml")
    with open(path, "w") as f:
        f.write(plan_text(ranks, layers, comment))
    return path


# --- the oracle runs --------------------------------------------------------------------------------

def write_oracle_data(path, x, targets):
    with h5py.File(path, "w") as f:
        f.create_dataset("inputs", data=x.numpy().astype(np.float32))
        f.create_dataset("targets", data=targets.astype(np.float32))


def write_train_data(path, x, targets, regression):
    """`tessera train`'s data: float32 `images` (used as they are) and integer class indices
    `labels`, or float32 regression `targets` (N x T)."""
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=x.numpy().astype(np.float32))
        if regression:
            f.create_dataset("targets", data=targets.astype(np.float32))
        else:
            f.create_dataset("labels", data=targets.astype(np.int32))


def compare_oracle(name, tag, output, model, reference):
    names = tessera_names(model)
    params = {k: v for k, v in names.items() if v.startswith("param/")}
    worst = {"loss": (0.0, ""), "grad": (0.0, ""), "param": (0.0, "")}
    worst_update = [(0.0, "")]

    def note(kind, error, what):
        if error > worst[kind][0] or not worst[kind][1]:
            worst[kind] = (error, what)
        check(error <= TOL, f"{name} {tag}: {what}: relative error {error:.3e} > {TOL}")

    with h5py.File(output, "r") as f:
        for step, expected in enumerate(reference["losses"]):
            key = f"loss_{step}"
            if check(key in f.attrs, f"{name} {tag}: {output} has no attribute {key}"):
                got = float(np.asarray(f.attrs[key]).reshape(-1)[0])
                note("loss", abs(got - expected) / abs(expected), f"loss of step {step} ({got!r} vs {expected!r})")
    grads = read_h5(output, ("grad/",))
    final = read_h5(output, ("param/",))
    expected_grads = {"grad/" + v[6:] for v in params.values()}
    check(set(grads) == expected_grads, f"{name} {tag}: gradients {sorted(grads)}, expected {sorted(expected_grads)}")
    check(set(final) == set(params.values()),
          f"{name} {tag}: parameters {sorted(final)}, expected {sorted(params.values())}")
    for key, tname in params.items():
        gname = "grad/" + tname[6:]
        ref_grad = reference["grads"][key]
        check(np.max(np.abs(ref_grad)) > 0, f"{name}: PyTorch's gradient of {key} is zero (the test proves nothing)")
        if gname in grads:
            check(np.max(np.abs(grads[gname])) > 0, f"{name} {tag}: Tessera's {gname} is zero")
            note("grad", rel_error(grads[gname], ref_grad), f"{gname} (shape {grads[gname].shape})")
        if tname in final:
            note("param", rel_error(final[tname], reference["state"][key]), f"{tname} after {STEPS} steps")
            # The steps' sum (final - initial): a wrong learning rate or step count shows here even
            # where it is small next to the weights. Float32 cancellation makes it less exact.
            initial = model.state_dict()[key].numpy()
            error = rel_error(final[tname] - initial, reference["state"][key] - initial)
            worst_update[0] = max(worst_update[0], (error, tname))
            check(error <= UPDATE_TOL, f"{name} {tag}: {tname}'s change over {STEPS} steps: relative error "
                                       f"{error:.3e} > {UPDATE_TOL}")
    print(f"{name} {tag}: max relative error: loss {worst['loss'][0]:.2e}, gradient {worst['grad'][0]:.2e} "
          f"({worst['grad'][1]}), parameter {worst['param'][0]:.2e} ({worst['param'][1]}), change of a parameter "
          f"{worst_update[0][0]:.2e} ({worst_update[0][1]})", flush=True)


def oracle_run(name, tag, directory, ranks, plan, data, model, reference):
    output = os.path.join(directory, f"oracle_{tag}.h5")
    command = [*mpirun(ranks), args.oracle, "--model", os.path.join(directory, "model.yaml"), "--weights",
               os.path.join(directory, "weights.h5"), "--data", data, "--steps", str(STEPS), "--lr", str(LR),
               "--output", output]
    if plan is not None:
        command += ["--plan", write_plan(directory, tag, plan)]
    if run_ok(command, f"{name} {tag}") and check(os.path.exists(output), f"{name} {tag}: no {output}"):
        compare_oracle(name, tag, output, model, reference)


def train_checkpoint(name, directory, x, targets, tag="train"):
    """`tessera train --init` for STEPS steps at 1 rank; the final checkpoint's path (or None)."""
    data = os.path.join(directory, f"{tag}_data.h5")
    write_train_data(data, x, targets, regression=targets.ndim > 1)
    checkpoints = os.path.join(directory, f"{tag}_ckpt")
    command = [*mpirun(1), args.tessera, "train", "--model", os.path.join(directory, "model.yaml"), "--init",
               os.path.join(directory, "weights.h5"), "--data", data, "--batch", str(x.shape[0]),
               # The file holds one batch: an epoch is one step, so --steps alone would stop after 1.
               "--epochs", str(STEPS), "--steps", str(STEPS), "--lr", str(LR), "--optimizer", "sgd", "--momentum",
               "0", "--no-shuffle", "--seed", "1", "--progress-every", "1", "--checkpoint-dir", checkpoints]
    if not run_ok(command, f"{name} tessera train"):
        return None
    path = os.path.join(checkpoints, f"ckpt-{STEPS:08d}.h5")
    found = sorted(os.listdir(checkpoints)) if os.path.isdir(checkpoints) else []
    return path if check(os.path.exists(path), f"{name}: no {path} after training (found {found})") else None


def compare_train(name, checkpoint, model, reference):
    names = tessera_names(model)
    saved = read_h5(checkpoint)
    worst = (0.0, "")
    for key, tname in names.items():
        if not check(tname in saved, f"{name} tessera train: {checkpoint} has no {tname}"):
            continue
        error = rel_error(saved[tname], reference["state"][key])
        worst = max(worst, (error, tname))
        check(error <= TOL, f"{name} tessera train: {tname} after {STEPS} steps: relative error {error:.3e} > {TOL}")
    print(f"{name} tessera train --init: max relative error after {STEPS} steps {worst[0]:.2e} ({worst[1]})",
          flush=True)


EXPECTED_LAYERS = {
    "fashion": [("conv1", "conv"), ("relu1", "relu"), ("pool1", "maxpool"), ("conv2", "conv"), ("relu2", "relu"),
                ("pool2", "maxpool"), ("flatten", "flatten"), ("fc1", "linear"), ("relu3", "relu"),
                ("fc2", "linear")],
    "residual": [("stem", "conv"), ("stem_bn", "batchnorm"), ("stem_act", "leaky_relu"), ("block_conv1", "conv"),
                 ("block_bn1", "batchnorm"), ("block_act1", "leaky_relu"), ("block_conv2", "conv"), ("add", "add"),
                 ("res_act", "relu"), ("pool1", "maxpool"), ("branch_a", "conv"), ("branch_b", "conv"),
                 ("concat", "concat"), ("pool2", "avgpool"), ("reshape", "flatten"), ("fc1", "linear"),
                 ("fc_act", "leaky_relu"), ("fc2", "linear")],
    "cosmo3d": [("conv1", "conv"), ("act1", "leaky_relu"), ("pool1", "maxpool"), ("conv2", "conv"),
                ("act2", "leaky_relu"), ("pool2", "maxpool"), ("flatten", "flatten"), ("fc1", "linear"),
                ("act3", "leaky_relu"), ("fc2", "linear")],
    "dropout": [("conv1", "conv"), ("act", "relu"), ("pool", "maxpool"), ("flatten", "flatten"),
                ("drop", "dropout"), ("fc", "linear")],
}


def prepare(name, directory):
    """Builds the network, exports and imports it; (model with the file's state, x, y, targets, loss,
    model file) or None."""
    os.makedirs(directory, exist_ok=True)
    model, x, y, targets, loss_fn, flags = make_problem(name)
    path = os.path.join(directory, f"{name}.onnx")
    export_onnx(model, x, path)
    load_onnx_state(model, path)
    imported = os.path.join(directory, "imported")
    if not import_model(path, imported, flags):
        return None
    m = check_import(name, model, imported, EXPECTED_LAYERS[name])
    return model, x, y, targets, loss_fn, m, imported


def network_case(name, plans):
    start = time.monotonic()
    work = os.path.join(args.work, name)
    prepared = prepare(name, work)
    if prepared is None:
        return
    model, x, y, targets, loss_fn, m, imported = prepared
    reference = pytorch_reference(model, x, y, loss_fn)
    print(f"{name}: PyTorch losses {reference['losses']}", flush=True)
    data = os.path.join(imported, "oracle_data.h5")
    write_oracle_data(data, x, targets)
    for tag, ranks, plan in plans(m):
        oracle_run(name, tag, imported, ranks, plan, data, model, reference)
    checkpoint = train_checkpoint(name, imported, x, targets)
    if checkpoint:
        compare_train(name, checkpoint, model, reference)
    print(f"{name}: {time.monotonic() - start:.1f} s", flush=True)


def fashion_plans(m):
    names = {layer["name"] for layer in m["layers"]}
    hybrid = {  # sample x filter, spatial tiles, a 2-D filter x channel grid, a channel split
        "conv1": {"sample": 2, "filter": 2}, "relu1": {"sample": 2, "filter": 2},
        "pool1": {"sample": 1, "spatial": [2, 2]},
        "conv2": {"sample": 1, "filter": 2, "channel": 2}, "relu2": {"sample": 2, "spatial": [2, 1]},
        "pool2": {"sample": 2, "spatial": [1, 2]},
        "fc1": {"sample": 1, "channel": 4},
    }
    check(set(hybrid) <= names, f"fashion: the hybrid plan names layers the model lacks: {set(hybrid) - names}")
    return [("np1", 1, None),
            ("spatial_np2", 2, spatial_plan(m, 2, [[2, 1], [1, 2]])),
            ("filter_np2", 2, filter_plan(m, 2)),
            ("sample2_filter2_np4", 4, filter_plan(m, 4, sample=2)),
            ("hybrid_np4", 4, (4, hybrid, "hybrid: sample x filter, spatial, filter x channel, channel"))]


def residual_plans(m):
    return [("np1", 1, None),
            ("spatial_np2", 2, spatial_plan(m, 2, [[2, 1], [1, 2]])),
            ("filter_np2", 2, filter_plan(m, 2)),
            ("filter_np3", 3, filter_plan(m, 3)),
            ("sample2_spatial2_np4", 4, spatial_plan(m, 4, [[2, 1], [1, 2]], sample=2))]


def cosmo3d_plans(m):
    return [("np1", 1, None),
            ("spatial_np2", 2, spatial_plan(m, 2, [[2, 1, 1], [1, 1, 2]])),
            ("filter_np2", 2, filter_plan(m, 2)),
            ("spatial_np4", 4, spatial_plan(m, 4, [[2, 2, 1], [1, 2, 2]]))]


def dropout_import_check():
    work = os.path.join(args.work, "dropout")
    prepared = prepare("dropout", work)
    if prepared is None:
        return
    m = prepared[5]
    drops = [layer for layer in m["layers"] if layer["type"] == "dropout"]
    check(len(drops) == 1 and float(drops[0].get("rate", -1)) == 0.25,
          f"dropout: model.yaml's dropout layers {drops}, expected one with rate: 0.25")
    with open(os.path.join(prepared[6], "model.yaml")) as f:
        text = f.read()
    check("type: dropout" in text and "rate: 0.25" in text,
          f"dropout: model.yaml lacks 'type: dropout'/'rate: 0.25':\n{text}")


# --- export: an ONNX interpreter on torch.nn.functional -------------------------------------------

def run_onnx(model_proto, x):
    graph = model_proto.graph
    env = {i.name: torch.from_numpy(np.array(numpy_helper.to_array(i))) for i in graph.initializer}
    inputs = [i.name for i in graph.input if i.name not in env]
    if len(inputs) != 1:
        raise ValueError(f"graph inputs besides initializers: {inputs}")
    env[inputs[0]] = x
    for node in graph.node:
        a = {attr.name: helper.get_attribute_value(attr) for attr in node.attribute}
        ins = [env[n] if n else None for n in node.input]
        op = node.op_type
        if node.domain not in ("", "ai.onnx"):
            raise ValueError(f"node {node.name}: domain {node.domain}")
        if op in ("Conv", "MaxPool", "AveragePool"):
            if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
                raise ValueError(f"node {node.name}: auto_pad {a['auto_pad']}")
            nd = (ins[1].dim() - 2) if op == "Conv" else len(a["kernel_shape"])
            pads = list(a.get("pads", [0] * 2 * nd))
            if pads[:nd] != pads[nd:]:
                raise ValueError(f"node {node.name}: asymmetric pads {pads}")
            strides = list(a.get("strides", [1] * nd))
            if nd not in (2, 3):
                raise ValueError(f"node {node.name}: {nd}-D")
        if op == "Conv":
            conv = F.conv2d if nd == 2 else F.conv3d
            y = conv(ins[0], ins[1], ins[2] if len(ins) > 2 else None, stride=strides, padding=pads[:nd],
                     dilation=list(a.get("dilations", [1] * nd)), groups=a.get("group", 1))
        elif op == "MaxPool":
            pool = F.max_pool2d if nd == 2 else F.max_pool3d
            y = pool(ins[0], list(a["kernel_shape"]), stride=strides, padding=pads[:nd],
                     dilation=list(a.get("dilations", [1] * nd)), ceil_mode=bool(a.get("ceil_mode", 0)))
        elif op == "AveragePool":
            pool = F.avg_pool2d if nd == 2 else F.avg_pool3d
            y = pool(ins[0], list(a["kernel_shape"]), stride=strides, padding=pads[:nd],
                     ceil_mode=bool(a.get("ceil_mode", 0)), count_include_pad=bool(a.get("count_include_pad", 0)))
        elif op == "BatchNormalization":
            if a.get("training_mode", 0):
                raise ValueError(f"node {node.name}: training_mode 1 in an inference graph")
            y = F.batch_norm(ins[0], ins[3], ins[4], weight=ins[1], bias=ins[2], training=False,
                             eps=a.get("epsilon", 1e-5))
        elif op == "Relu":
            y = F.relu(ins[0])
        elif op == "LeakyRelu":
            y = F.leaky_relu(ins[0], a.get("alpha", 0.01))
        elif op == "Gemm":
            A = ins[0].t() if a.get("transA", 0) else ins[0]
            B = ins[1].t() if a.get("transB", 0) else ins[1]
            y = a.get("alpha", 1.0) * (A @ B)
            if len(ins) > 2 and ins[2] is not None:
                y = y + a.get("beta", 1.0) * ins[2]
        elif op == "Flatten":
            axis = a.get("axis", 1)
            shape = ins[0].shape
            y = ins[0].reshape(int(np.prod(shape[:axis])), -1)
        elif op == "Add":
            y = ins[0] + ins[1]
        elif op == "Concat":
            y = torch.cat(ins, dim=a["axis"])
        elif op in ("Dropout", "Identity"):
            if op == "Dropout" and len(ins) > 2 and ins[2] is not None and bool(ins[2].item()):
                raise ValueError(f"node {node.name}: Dropout with training_mode true")
            y = ins[0]
        else:
            raise ValueError(f"node {node.name}: operator {op} is not in the interpreter")
        env[node.output[0]] = y
        for extra in node.output[1:]:
            if extra:
                raise ValueError(f"node {node.name} ({op}) has a second output '{extra}'")
    return env[graph.output[0].name]


EXPORT_OPS = {"Conv", "MaxPool", "AveragePool", "BatchNormalization", "Relu", "LeakyRelu", "Gemm", "Flatten", "Add",
              "Concat", "Dropout"}


def check_exported(name, path, torch_model, layer_names, sample_shape):
    """onnx.checker, the promised structure, and the interpreter against the PyTorch module (eval)."""
    try:
        proto = onnx.load(path)
        onnx.checker.check_model(proto, full_check=True)
    except Exception as e:  # noqa: BLE001 - any failure of the checker is the finding
        check(False, f"{name}: {path} fails onnx.checker: {e}")
        return
    graph = proto.graph
    opsets = {o.domain: o.version for o in proto.opset_import}
    check(opsets.get("", opsets.get("ai.onnx")) == OPSET, f"{name}: opset_import {opsets}, expected {OPSET}")
    init_names = {i.name for i in graph.initializer}
    real_inputs = [i for i in graph.input if i.name not in init_names]
    if check(len(real_inputs) == 1 and real_inputs[0].name == "input",
             f"{name}: graph inputs {[i.name for i in real_inputs]}, expected ['input']"):
        dims = real_inputs[0].type.tensor_type.shape.dim
        check(len(dims) == 1 + len(sample_shape) and not dims[0].HasField("dim_value")
              and [d.dim_value for d in dims[1:]] == list(sample_shape),
              f"{name}: input shape {[d.dim_param or d.dim_value for d in dims]}, expected [batch, {sample_shape}]")
    check(len(graph.output) == 1, f"{name}: {len(graph.output)} graph outputs")
    expected_inits = {k for k in torch_model.state_dict() if not k.endswith("num_batches_tracked")}
    # Dropout's ratio is an input in opset 13: a scalar initializer of the rate is fine.
    ratios = {n.input[1]: n.name for n in graph.node if n.op_type == "Dropout" and len(n.input) > 1 and n.input[1]}
    rates = {m.p for m in torch_model.modules() if isinstance(m, nn.Dropout)}
    for i in graph.initializer:
        if i.name in ratios:
            value = numpy_helper.to_array(i)
            check(value.size == 1 and float(value.reshape(-1)[0]) in rates,
                  f"{name}: Dropout {ratios[i.name]}'s ratio {value}, expected one of {rates}")
    check(init_names - set(ratios) == expected_inits,
          f"{name}: initializers {sorted(init_names)}, expected {sorted(expected_inits)} (and Dropout ratios)")
    ops = {n.op_type for n in graph.node}
    check(ops <= EXPORT_OPS, f"{name}: operators {sorted(ops - EXPORT_OPS)} outside the promised set")
    node_names = [n.name for n in graph.node]
    check(set(node_names) == set(layer_names) and len(node_names) == len(layer_names),
          f"{name}: node names {node_names}, expected the layers {layer_names}")
    for n in graph.node:
        at = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        if n.op_type == "AveragePool":
            check(at.get("count_include_pad", 0) == 0,
                  f"{name}: {n.name}: count_include_pad {at.get('count_include_pad')}")
        if n.op_type == "BatchNormalization":
            check(len([o for o in n.output if o]) == 1, f"{name}: {n.name}: {len(n.output)} outputs")
        if n.op_type == "Gemm":
            check(at.get("transB", 0) == 1, f"{name}: {n.name}: transB {at.get('transB', 0)}")
    torch_model.eval()
    g = torch.Generator().manual_seed(5)
    for batch in (1, 5):
        x = torch.randn(batch, *sample_shape, generator=g)
        try:
            with torch.no_grad():
                got = run_onnx(proto, x)
        except Exception as e:  # noqa: BLE001
            check(False, f"{name}: the interpreter fails on {path}: {e}")
            return
        with torch.no_grad():
            expected = torch_model(x)
        error = rel_error(got.numpy(), expected.numpy())
        print(f"{name} export: batch {batch}: max relative error of the outputs {error:.2e}", flush=True)
        check(tuple(got.shape) == tuple(expected.shape) and error <= TOL,
              f"{name} export: batch {batch}: outputs {tuple(got.shape)} vs PyTorch {tuple(expected.shape)}, "
              f"relative error {error:.3e} > {TOL}")


def torch_from_weights(model, weights_path):
    """A copy of `model` holding a Tessera weights file's or checkpoint's parameters and buffers."""
    m = copy.deepcopy(model)
    saved = read_h5(weights_path)
    names = tessera_names(m)
    with torch.no_grad():
        for key, value in m.state_dict().items():
            if key in names and check(names[key] in saved, f"{weights_path}: no {names[key]}"):
                value.copy_(torch.from_numpy(saved[names[key]]))
    return m


def export_model(source, out, name):
    if os.path.exists(out):
        os.remove(out)
    return run_ok([args.tessera, "export", "onnx", "--checkpoint", source, "-o", out], f"{name}: export") and \
        check(os.path.exists(out), f"{name}: export wrote no {out}")


def round_trip(name, work, imported):
    exported = os.path.join(work, f"{name}_exported_for_round_trip.onnx")
    again = os.path.join(work, "reimported")
    if not export_model(os.path.join(imported, "weights.h5"), exported, name):
        return
    if not import_model(exported, again):  # no --loss: the graph carries its loss and name
        return
    with open(os.path.join(imported, "model.yaml")) as f:
        first = f.read()
    with open(os.path.join(again, "model.yaml")) as f:
        second = f.read()
    check(first == second, f"{name} round trip: model.yaml differs:\n--- first\n{first}--- second\n{second}")
    a = read_h5(os.path.join(imported, "weights.h5"))
    b = read_h5(os.path.join(again, "weights.h5"))
    check(set(a) == set(b), f"{name} round trip: datasets {sorted(a)} vs {sorted(b)}")
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if x.dtype != y.dtype or x.shape != y.shape:
            check(False, f"{name} round trip: {key} is {x.dtype} {x.shape}, then {y.dtype} {y.shape}")
        elif x.tobytes() != y.tobytes():
            diff = np.max(np.abs(x.astype(np.float64) - y))
            check(False, f"{name} round trip: {key} differs (max |difference| {diff:.3e})")
    print(f"{name} round trip: model.yaml identical: {first == second}; {len(a)} datasets compared bitwise", flush=True)


def export_case():
    start = time.monotonic()
    for name in ("fashion", "residual", "dropout", "cosmo3d"):
        work = os.path.join(args.work, "export", name)
        prepared = prepare(name, work)
        if prepared is None:
            continue
        model, x, y, targets, loss_fn, m, imported = prepared
        layer_names = [layer["name"] for layer in m["layers"]]
        sample_shape = list(x.shape[1:])
        if name in ("fashion", "residual"):
            checkpoint = train_checkpoint(name, imported, x, targets)
            if checkpoint:
                out = os.path.join(work, f"{name}_trained.onnx")
                if export_model(checkpoint, out, name):
                    trained = torch_from_weights(model, checkpoint)
                    check_exported(f"{name} (trained)", out, trained, layer_names, sample_shape)
                    # The exported initializers are the checkpoint's tensors, bit for bit.
                    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(out).graph.initializer}
                    saved = read_h5(checkpoint)
                    for key, tname in tessera_names(model).items():
                        if key in inits and tname in saved:
                            check(np.array_equal(inits[key], saved[tname]),
                                  f"{name}: exported initializer {key} differs from the checkpoint's {tname}")
        else:  # the imported weights (dropout, 3-D convolutions and pools)
            out = os.path.join(work, f"{name}_exported.onnx")
            if export_model(os.path.join(imported, "weights.h5"), out, name):
                check_exported(name, out, copy.deepcopy(model), layer_names, sample_shape)
        round_trip(name, work, imported)
    print(f"export: {time.monotonic() - start:.1f} s", flush=True)


# --- bad input --------------------------------------------------------------------------------------

class SigmoidNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.flatten(torch.sigmoid(self.conv1(x)), 1))


class GroupedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1, groups=2)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.flatten(F.relu(self.conv1(x)), 1))


def gemm_mismatch_model(path):
    """Input N x 1 x 4 x 4, Flatten (16 features), a Gemm whose weight expects 10."""
    rng = np.random.default_rng(3)
    weight = numpy_helper.from_array(rng.standard_normal((3, 10)).astype(np.float32), "fc.weight")
    bias = numpy_helper.from_array(np.zeros(3, np.float32), "fc.bias")
    nodes = [helper.make_node("Flatten", ["input"], ["flat"], name="/flatten/Flatten", axis=1),
             helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["out"], name="/fc/Gemm", transB=1)]
    graph = helper.make_graph(nodes, "mismatch",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [2, 1, 4, 4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])], [weight, bias])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), path)


def expect_refused(name, onnx_path, word):
    out_dir = os.path.join(args.work, "bad-input", f"out_{name}")
    shutil.rmtree(out_dir, ignore_errors=True)
    result = run([args.tessera, "import", "onnx", onnx_path, "-o", out_dir], f"bad input {name}", timeout=60)
    if result is None:
        return
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("tessera: error")]
    check(result.returncode == 2, f"bad input {name}: exit {result.returncode}, expected 2; stderr: {result.stderr!r}")
    check(len(errors) == 1 and lines and lines[0].startswith("tessera: error"),
          f"bad input {name}: expected one 'tessera: error' message on stderr, got {result.stderr!r}")
    check(word.lower() in result.stderr.lower(), f"bad input {name}: stderr does not say '{word}': {result.stderr!r}")
    left = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    check(not left, f"bad input {name}: {out_dir} holds {left} after a failed import")
    print(f"bad input {name}: exit {result.returncode}: {errors[0] if errors else result.stderr.strip()}", flush=True)


def bad_input_case():
    work = os.path.join(args.work, "bad-input")
    os.makedirs(work, exist_ok=True)
    torch.manual_seed(7)
    real = os.path.join(work, "real.onnx")
    export_onnx(DropoutNet(), torch.rand(2, 1, 8, 8), real)
    with open(real, "rb") as f:
        data = f.read()
    truncated = os.path.join(work, "truncated.onnx")
    with open(truncated, "wb") as f:
        f.write(data[:len(data) // 2])
    random_bytes = os.path.join(work, "random.onnx")
    with open(random_bytes, "wb") as f:
        f.write(np.random.default_rng(11).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    empty = os.path.join(work, "empty.onnx")
    open(empty, "wb").close()
    sigmoid = os.path.join(work, "sigmoid.onnx")
    export_onnx(SigmoidNet(), torch.rand(2, 1, 6, 6), sigmoid)
    grouped = os.path.join(work, "grouped.onnx")
    export_onnx(GroupedNet(), torch.rand(2, 2, 6, 6), grouped)
    mismatch = os.path.join(work, "mismatch.onnx")
    gemm_mismatch_model(mismatch)

    # The real file imports (so the failures below are the damage, not the network).
    check(import_model(real, os.path.join(work, "out_real")), "bad input: the undamaged file does not import")
    expect_refused("truncated", truncated, "ONNX")
    expect_refused("random", random_bytes, "ONNX")
    expect_refused("empty", empty, "empty")
    expect_refused("missing", os.path.join(work, "no_such.onnx"), "no such file")
    expect_refused("sigmoid", sigmoid, "Sigmoid")
    expect_refused("grouped", grouped, "group")
    expect_refused("gemm-mismatch", mismatch, "chain")

    # `tessera train --init` with the weights of another model: exit 2 on every rank, one message.
    imported = os.path.join(work, "out_real")
    with open(os.path.join(imported, "model.yaml")) as f:
        text = f.read()
    other = re.sub(r"filters: (\d+)", lambda m: f"filters: {int(m.group(1)) + 1}", text, count=1)
    check(other != text, "bad input: found no conv to change in the imported model")
    other_model = os.path.join(work, "other_model.yaml")
    with open(other_model, "w") as f:
        f.write(other)
    data = os.path.join(work, "train.h5")
    write_train_data(data, torch.rand(4, 1, 8, 8), np.arange(4), regression=False)
    result = run(mpirun(2) + [args.tessera, "train", "--model", other_model, "--init",
                              os.path.join(imported, "weights.h5"), "--data", data, "--batch", "4", "--steps", "1"],
                 "bad input init-other-model", timeout=120)
    if result is not None:
        errors = [line for line in result.stderr.splitlines() if line.startswith("tessera: error")]
        check(result.returncode == 2, f"bad input init-other-model: exit {result.returncode}, expected 2: {result.stderr!r}")
        check(len(errors) == 1 and "another model" in errors[0],
              f"bad input init-other-model: expected one message naming another model, got {result.stderr!r}")
        print(f"bad input init-other-model: exit {result.returncode}: {errors[0] if errors else ''}", flush=True)


if "fashion" in cases:
    network_case("fashion", fashion_plans)
if "residual" in cases:
    network_case("residual", residual_plans)
    dropout_import_check()
if "cosmo3d" in cases:
    network_case("cosmo3d", cosmo3d_plans)
if "export" in cases:
    export_case()
if "bad-input" in cases:
    bad_input_case()

exit_if_failed()
print(f"onnx {', '.join(cases)}: every check passed")
