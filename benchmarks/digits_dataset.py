"""A small real dataset for ResNet-18 on a CPU: UCI's handwritten digits as MNIST-format IDX files.

``benchmarks/data/digits.csv.gz`` holds the 1797 8x8 images of handwritten digits (16 grey levels) of the UCI
"Optical Recognition of Handwritten Digits" test set, as scikit-learn bundles them (``sklearn.datasets.load_digits``
reads this file: the same arrays, no download, no scikit-learn needed; ``benchmarks/data/README.md`` names the
source). This script scales them to 0..255, resizes them to 28x28 (bilinear, ``mx.nd.contrib.BilinearResize2D``),
shuffles them with ``--seed`` and writes the first ``--num-train`` as the training set, the rest as the test set, in
the four IDX files of an MNIST-format directory (each written atomically by ``parallel.data.write_idx``), which
``python -m parallel.train --data-dir DIR`` reads:

    python benchmarks/digits_dataset.py --out digits
    python -m parallel.train --model resnet18 --data-dir digits --devices cpu:1 --epochs 3 --batch-size 64 --lr 0.05
"""
import argparse
import os
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402


#: The digits as scikit-learn bundles them: one row an image, its 64 grey levels (0..16) then its label.
DIGITS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")


def load_digits():
    """The 1797 digits: images (1797, 8, 8) of grey levels 0..16 (float64) and labels (1797,), as scikit-learn's
    ``load_digits`` returns them from the same file."""
    data = np.loadtxt(DIGITS_FILE, delimiter=",")
    return data[:, :-1].reshape((-1, 8, 8)), data[:, -1].astype(int)


def digits_dataset(num_train=1500, size=28, seed=0):
    """UCI's digits as a ``parallel.data.Dataset``: uint8 images (n, size, size), uint8 labels.

    Parameters
    ----------
    num_train : int
        Examples in the training set (1 .. 1796); the other 1797 - num_train are the test set.
    size : int
        Side of the resized images (>= 8).
    seed : int
        Seeds the shuffle that splits the examples.
    """
    import mxnet as mx
    from parallel.data import Dataset

    digit_images, digit_labels = load_digits()
    n = len(digit_labels)
    if not 1 <= num_train < n:
        raise ValueError(f"--num-train must be between 1 and {n - 1} (the digits hold {n} examples), got {num_train}")
    if size < 8:
        raise ValueError(f"--size must be >= 8 (the digits are 8x8), got {size}")
    images = mx.nd.array(digit_images[:, None] * (255.0 / 16.0))   # 0..16 grey levels -> 0..255
    resized = mx.nd.contrib.BilinearResize2D(images, height=size, width=size).asnumpy()[:, 0]
    images = np.clip(np.rint(resized), 0, 255).astype(np.uint8)
    labels = digit_labels.astype(np.uint8)
    order = np.random.RandomState(seed).permutation(n)
    train, test = order[:num_train], order[num_train:]
    return Dataset(images[train], labels[train], images[test], labels[test])


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write UCI's handwritten digits, resized, as MNIST-format IDX files.")
    parser.add_argument("--out", required=True, help="directory to write the four IDX files into (created)")
    parser.add_argument("--num-train", type=int, default=1500, help="training examples; the rest are the test set "
                                                                    "(default 1500 of 1797)")
    parser.add_argument("--size", type=int, default=28, help="side of the resized images (default 28)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the train/test split (default 0)")
    args = parser.parse_args(argv)
    try:
        dataset = digits_dataset(args.num_train, args.size, args.seed)
    except ValueError as e:
        parser.error(str(e))
    harness.write_dataset(args.out, dataset)
    print(f"wrote {len(dataset.train_labels)} train / {len(dataset.test_labels)} test digits of "
          f"{args.size}x{args.size} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
