from pathlib import Path

from setuptools import find_packages, setup

# The peers bench/peers.py measures (CPU builds), in the test extra too so that their adapters are
# tested. One with no wheel for a platform is reported "not installed" by bench/run.py.
PEERS = [
    "tensorflow-cpu; platform_machine == 'x86_64' or platform_machine == 'AMD64'",
    "tensorflow; platform_machine != 'x86_64' and platform_machine != 'AMD64'",
    "torchdata>=0.10",  # torchdata.nodes
    "spdl",
    "grain",
]

# The linter and the type checker .ci/run runs, pinned so that CI and developers check alike.
CHECKERS = ["ruff==0.17.6", "mypy==2.4.1"]

setup(
    name="torchpipe",
    version="0.1.0",
    description="tf.data-style input pipelines and a drop-in DataLoader for PyTorch",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torchpipe", "torchpipe.*"]),
    # py.typed (PEP 561): type checkers read the package's own hints.
    package_data={"torchpipe": ["py.typed"]},
    include_package_data=True,
    python_requires=">=3.10",
    # crc32c: hardware CRC32C for TFRecord integrity checks (docs/formats.md says why this one).
    # simplejpeg: tp.image's JPEG decoder, a 0.4 MB wheel that bundles libjpeg-turbo (docs/image.md).
    install_requires=["torch>=2.1", "numpy", "pillow", "psutil", "crc32c>=2.3", "simplejpeg>=1.7"],
    extras_require={
        "test": [*CHECKERS, "pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "fsspec", "s3fs",
                 "moto[server]>=5", "webdataset", "tqdm", "matplotlib", "ray[data]>=2.10", "accelerate>=1.0",
                 "transformers>=4.40", *PEERS],
        "remote": ["fsspec", "s3fs"],
        "progress": ["tqdm"],  # progress bars on save, snapshot and cache(path) fills
        "plot": ["matplotlib"],  # it.stats().plot(path): the timeline PNG
        "ray": ["ray[data]>=2.10"],  # executor="ray", tp.from_ray (Ray Data needs pyarrow and pandas)
        "accelerate": ["accelerate>=1.0"],  # torchpipe.integrations.accelerate (Trainer: transformers too)
        "bench": ["matplotlib", *PEERS],
    },
    license="BSD-3-Clause",
)
