"""A full-weight version's publish and its verify: in the store that published it, and in a reader.

    python benchmarks/probes/store_verify_probe.py --shape qwen2.5-0.5b --out DIR

The pipeline publishes each full-weight version through its AdapterStore (save_pretrained into a
temporary directory, the sha256 of every file, the rename) and its adapter loop verifies the
directory before any engine reads it. The publishing store verifies its own untouched files by
their identity (no second read); any other store (a reader elsewhere) hashes every file, as the
publishing one also did before. This times, for the same versions in one process: the publish,
the verify in the publishing store, and the verify in a fresh reader store (medians over
--repeats). Writes <out>/store_verify_<shape>_<hardware>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

from pipeline.models import builtin as models  # noqa: E402
from pipeline.store.weights import AdapterStore  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sync", action="store_true", help="fsync as a store opened with sync=True does")
    p.add_argument("--model-cache", default="runs/models")
    p.add_argument("--out", default=str(common.RESULTS_DIR))
    a = p.parse_args()

    model_dir = models.build_model(a.shape, a.model_cache)
    model = models.load_causal_lm(model_dir, "cpu", models.SHAPES[a.shape].dtype)
    nbytes = sum(t.numel() * t.element_size() for t in model.parameters())
    times: dict[str, list[float]] = {"publish_s": [], "verify_publisher_s": [], "verify_reader_s": []}
    with tempfile.TemporaryDirectory(prefix="store-verify-", dir=a.model_cache) as root:
        store = AdapterStore(root, base_model=str(model_dir), keep_last=2, kind="full", sync=a.sync)
        for version in range(1, a.repeats + 1):
            t0 = time.perf_counter()
            with models.quiet_progress():
                ref = store.publish(version, lambda d: model.save_pretrained(str(d)))
            t1 = time.perf_counter()
            assert store.verify_dir(ref.path) == ref
            t2 = time.perf_counter()
            assert AdapterStore(root, kind="full", readonly=True).verify_dir(ref.path) == ref
            t3 = time.perf_counter()
            for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[key].append(value)
            print(f"version {version}: publish {t1 - t0:.3f} s, verify in the publisher {t2 - t1:.4f} s, "
                  f"in a reader {t3 - t2:.3f} s", flush=True)
            store.prune(version)
    medians = {k: statistics.median(v) for k, v in times.items()}
    printed = (f"{a.shape}: {nbytes / 1e9:.2f} GB of weights; medians over {a.repeats}: publish "
               f"{medians['publish_s']:.3f} s, verify in the publishing store {medians['verify_publisher_s']:.4f} s, "
               f"in a reader {medians['verify_reader_s']:.3f} s")
    print(printed)
    hw = common.hardware(gpus=False)
    out = Path(a.out) / f"store_verify_{a.shape}_{common.hardware_tag(hw)}.json"
    common.write_json(out, {**common.header("store_verify_probe", sys.argv[1:]), "hardware": hw, "settings": vars(a),
                            "weights_bytes": nbytes, "medians": medians, "times": times, "printed": printed})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
