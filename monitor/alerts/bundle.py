"""Evidence bundles: what a rank knew when an incident was found, kept on disk next to its
anomaly files, for reproducing and debugging the fault later.

``anomaly_detected/rank{R}/bundle_incident{N}/``:

* ``manifest.json``: the incident (onset step, root, evidence, batch ids), the step at which
  the bundle was written, config, versions, topology (rank, world size, pipeline stage and
  mates, model chunks, process groups), which module's inputs it holds, the random generators'
  states (Python's in the manifest, the others as arrays), and per tensor its file, shape,
  original dtype and what it is;
* ``{name}.npy``: each tensor as a NumPy array (bfloat16 and other types NumPy lacks as
  float32; the manifest keeps the original dtype), read without any framework by
  ``load_bundle``.

The bundle is written on the training thread at the end of the step where the incident began:
while bundles are wanted, each collected step waits for the writer to judge it (as ``skip_step``
does). Its tensors are the state then: the gradient itself (until ``zero_grad``), the parameter
after the update, the optimizer's moments, and the inputs a module received during the step.
Tensors beyond the size limit are listed as left out. The directory is written under a
temporary name and renamed, so a reader never sees half a bundle.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from monitor.files import DIR_MODE, atomic_write_text, create_exclusive, make_private_dir

MANIFEST = "manifest.json"
BUNDLE_VERSION = 1
#: tensor name -> (array or None when not copied, original dtype, what it is, shape)
Tensors = dict[str, tuple[np.ndarray | None, str, str, tuple[int, ...]]]


def host_generators() -> tuple[dict[str, Any], Tensors]:
    """Python's and NumPy's global random generators: their states for the manifest, NumPy's
    key as an array."""
    state = np.random.get_state()
    key = np.asarray(state[1])
    rng = {
        "python": random.getstate(),
        "numpy": {"algorithm": state[0], "pos": state[2], "has_gauss": state[3], "cached_gaussian": state[4]},
    }
    return rng, {"rng.numpy": (key, "uint32", "numpy's global generator: key", key.shape)}


class TensorBudget:
    """A bundle's tensors in order of importance: each is copied to the host only while the
    copies fit in ``budget`` bytes; past it a tensor is listed (None), never copied off its device."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        self.tensors: Tensors = {}

    def add(
        self, name: str, shape: tuple[int, ...], dtype: str, nbytes: int, what: str, copy: Callable[[], Any]
    ) -> None:
        """Add ``name``: ``copy()`` returns its host array; ``nbytes`` is that array's size."""
        if nbytes > self.left:
            self.tensors[name] = (None, dtype, what, shape)
            return
        self.left -= nbytes
        self.tensors[name] = (copy(), dtype, what, shape)


@dataclass
class Bundle:
    """A bundle read back: its manifest and its tensors by name."""

    path: str
    manifest: dict[str, Any]
    tensors: dict[str, np.ndarray]


def write_bundle(
    directory: str,
    incident: Mapping[str, Any],
    facts: Mapping[str, Any],
    tensors: Mapping[str, tuple[np.ndarray | None, str, str, tuple[int, ...]]],
    max_bytes: int,
) -> str:
    """Write one bundle under ``directory`` (the rank's anomaly directory); returns its path.

    Args:
        incident: the incident's JSON (``Incident.to_json``).
        facts: config, versions, topology, step, RNG states: JSON-ready.
        tensors: name -> (array, original dtype, what it is, shape), in order of importance; an
            array None (not copied: the caller's budget was spent) and those past ``max_bytes``
            in total are listed as left out.
    """
    make_private_dir(directory)
    target = os.path.join(directory, f"bundle_incident{incident['id']}")
    work = tempfile.mkdtemp(prefix=".tmp-bundle-", dir=directory)
    try:
        os.chmod(work, DIR_MODE)  # the outputs' modes: a bundle is an output like the others
        listed, left_out, used = [], [], 0
        for index, (name, (array, dtype, what, shape)) in enumerate(tensors.items()):
            if array is None or used + array.nbytes > max_bytes:
                left_out.append({"name": name, "dtype": dtype, "shape": list(shape), "what": what})
                continue
            file = f"{index:03d}.npy"
            with os.fdopen(create_exclusive(os.path.join(work, file)), "wb") as handle:
                np.save(handle, array, allow_pickle=False)
            used += array.nbytes
            listed.append(
                {"name": name, "file": file, "dtype": dtype, "shape": list(array.shape), "what": what}
            )
        manifest = {
            "version": BUNDLE_VERSION,
            "incident": incident,
            **facts,
            "python": platform.python_version(),
            "tensors": listed,
            "left_out": left_out,
            "max_bytes": max_bytes,
        }
        atomic_write_text(os.path.join(work, MANIFEST), json.dumps(manifest, indent=1, default=str))
        if os.path.lexists(target):
            shutil.rmtree(target)  # a restart numbering its incidents as before replaces its bundle
        os.replace(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return target


def load_bundle(path: str | os.PathLike) -> Bundle:
    """Read a bundle directory: ``bundle.manifest`` and ``bundle.tensors[name]`` (NumPy arrays).

    Raises:
        ValueError: the directory is not a bundle, or a file it lists is missing or damaged.
    """
    path = os.fspath(path)
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as handle:
            manifest = json.load(handle)
        tensors = {
            entry["name"]: np.load(os.path.join(path, entry["file"]), allow_pickle=False)
            for entry in manifest["tensors"]
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a readable trainmon bundle ({exc})") from None
    return Bundle(path, manifest, tensors)


def _generators(manifest: dict[str, Any]) -> list[str]:
    """The random generators whose state a bundle kept: in its manifest (Python's, numpy's
    position) or as tensors named ``rng.{generator}`` (numpy's key, torch's CPU and GPU states)."""
    names = set(manifest.get("rng", {}))
    names.update(
        e["name"].removeprefix("rng.") for e in manifest.get("tensors", []) if e["name"].startswith("rng.")
    )
    return sorted(names)


def _groups_line(groups: Mapping[str, Any]) -> list[str]:
    """The process groups a bundle's topology names (those the run had), as one line."""
    known = [f"{name} {ranks}" for name, ranks in groups.items() if ranks is not None]
    return [f"groups (global ranks): {', '.join(known)}"] if known else []


def _inputs_line(inputs: Mapping[str, Any] | None) -> list[str]:
    """Which module's inputs a bundle holds, and those written in place after the call."""
    if not inputs:
        return []
    line = f"inputs of module {inputs['module']} at micro-batch {inputs['micro_step']}"
    changed = inputs.get("changed_in_place") or []
    if changed:
        line += f" (input {', '.join(map(str, changed))} written in place after the call: not kept)"
    return [line]


def _batch_ids(ids: Any) -> str:
    return json.dumps(ids) if ids else "not named (mon.set_batch_ids)"


def describe_bundle(bundle: Bundle) -> str:
    """The text ``trainmon bundle show`` prints: the incident, where it ran, and each tensor."""
    m = bundle.manifest
    incident = m.get("incident", {})
    root = incident.get("root", {})
    topology = m.get("topology", {})
    lines = [
        f"bundle {bundle.path}",
        f"incident {incident.get('id')} on rank {incident.get('rank')}: onset step "
        f"{incident.get('onset_step')} (micro-batch {incident.get('onset_micro_step')}), "
        f"written at the end of step {m.get('written_at_step')}",
        f"root: {root.get('tag_name')} {root.get('op', '')} = {root.get('value')} ({root.get('rule')})",
        *(f"  - {line}" for line in incident.get("evidence", [])),
        f"batch ids: {_batch_ids(incident.get('batch_ids'))}",
        f"rank {topology.get('rank')} of {topology.get('world_size')}, pipeline stage "
        f"{topology.get('pp_stage')}, model chunks {topology.get('chunks')}",
        *_groups_line(topology.get("groups") or {}),
        *_inputs_line(m.get("module_inputs")),
        "versions: " + ", ".join(f"{k} {v}" for k, v in sorted(m.get("versions", {}).items())),
        f"random generator states: {', '.join(_generators(m)) or 'none'}",
        "tensors:",
    ]
    for entry in m.get("tensors", []):
        array = bundle.tensors[entry["name"]]
        finite = array[np.isfinite(array)] if array.dtype.kind == "f" else array
        summary = f"min {finite.min():.4g} max {finite.max():.4g}" if finite.size else "no finite value"
        nans = int(np.isnan(array).sum()) if array.dtype.kind == "f" else 0
        shape = f"{entry['dtype']} {tuple(entry['shape'])}"
        lines.append(f"  {entry['name']}  {entry['what']}  {shape}  {summary}  nan {nans}")
    for entry in m.get("left_out", []):
        lines.append(f"  {entry['name']}  {entry['what']}  left out (over the size limit)")
    return "\n".join(lines)
