"""Write the demo's TensorFlow story: a TF1 ``Saver`` checkpoint of an MLP trained with Adam.

The file ships inside the package because TensorFlow is never a modelsize dependency; it is
the classic "checkpoint three times the size of its weights" case (``<var>/Adam`` and
``<var>/Adam_1`` beside every variable). Regenerate with a Python that has TensorFlow::

    /tmp/tfvenv/bin/python src/modelsize/demo_data/generate.py

MANIFEST.json records the TensorFlow version, each file's sha256 and byte counts taken from
TensorFlow's own ``tf.train.list_variables``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

HERE = Path(__file__).absolute().parent  # run by the TF venv: no modelsize import
OUT = HERE / "tf1_mlp_adam"
tf1 = tf.compat.v1


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    graph = tf1.Graph()
    with graph.as_default():
        tf1.set_random_seed(0)
        x = tf1.placeholder(tf.float32, (None, 784))
        y = tf1.placeholder(tf.int64, (None,))
        def dense(inp: tf.Tensor, n_in: int, n_out: int, name: str) -> tf.Tensor:
            with tf1.variable_scope(name):
                w = tf1.get_variable("kernel", (n_in, n_out), tf.float32,
                                     tf1.glorot_uniform_initializer())
                b = tf1.get_variable("bias", (n_out,), tf.float32, tf1.zeros_initializer())
            return tf.matmul(inp, w) + b

        h = tf.nn.relu(dense(x, 784, 64, "hidden"))
        logits = dense(h, 64, 10, "logits")
        loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        step = tf1.train.get_or_create_global_step()
        train = tf1.train.AdamOptimizer(1e-3).minimize(loss, global_step=step)
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            rng = np.random.default_rng(0)
            sess.run(train, {x: rng.standard_normal((32, 784)), y: rng.integers(0, 10, 32)})
            saver.save(sess, str(OUT / "model.ckpt"))
    prefix = str(OUT / "model.ckpt")
    variables = tf.train.list_variables(prefix)
    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    sizes = {n: int(np.prod(s, dtype=np.int64)) * dtypes[n].size for n, s in variables}
    manifest = {
        "tensorflow": tf.__version__,
        "files": {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(OUT.iterdir())
        },
        "weights": sum(
            n for k, n in sizes.items() if "/Adam" not in k and k.startswith(("hidden", "logits"))
        ),
        "optimizer_state": sum(
            n for k, n in sizes.items() if "/Adam" in k or "power" in k or k == "global_step"
        ),
        "variables": sizes,
    }
    (HERE / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
