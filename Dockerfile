# kvconductor in one image: the daemon (`kvconductor run`), the engine bridge
# (`kvconductor bridge`), the demo engines (`kvconductor demo --engines-only`)
# and the operator tools (`kvconductor query | status | dead-letters`).
#
#   docker build -t kvconductor:dev .
#   docker run --rm -e KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS=broker:9092 -p 8787:8787 kvconductor:dev
#
# Configuration: /etc/kvconductor/*.toml (the repository's config/ folder),
# overridden by KVCONDUCTOR_<SECTION>_<KEY> environment variables
# (docs/configuration.md).
#
# The image runs the compiled query kernel (kernel/, built by the Rust stage
# below); the build fails rather than ship the slower pure-Python path, and
# the daemon's start-up line says which path runs (`query_path=compiled`).
# tests/test_dockerfile.py replays the build stage from the repository's files.

FROM rust:1-slim AS rust

# Python 3.11 in both stages: the kernel reads a prompt's token ids from
# CPython 3.11's int objects (kernel/src/small_int.rs, compiled for 3.11
# only, kernel/build.rs), and every figure in docs/benchmarks.md is 3.11's.
FROM python:3.11-slim AS build
# Rust's toolchain from the stage above, and a C linker for it.
COPY --from=rust /usr/local/cargo /usr/local/cargo
COPY --from=rust /usr/local/rustup /usr/local/rustup
ENV CARGO_HOME=/usr/local/cargo \
    RUSTUP_HOME=/usr/local/rustup \
    PATH=/usr/local/cargo/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
# The kernel's Cargo workspace whole: Cargo.toml and Cargo.lock, core/ (no
# Python) and py/ (the PyO3 module the wheel builds, pyproject.toml's path).
COPY kernel ./kernel
COPY kvconductor ./kvconductor
# Wheels of kvconductor (with its compiled kernel) and of every dependency,
# so the runtime stage needs no compiler. The `bridge` extra (pyzmq) serves
# `kvconductor bridge` and the demo engines; the demo's rich is left out
# (its output is plain text without it).
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[bridge]'

FROM python:3.11-slim
RUN useradd --system --uid 10001 --no-create-home kvconductor
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels 'kvconductor[bridge]' && rm -rf /wheels
# The kernel is optional at install (pyproject.toml): here its absence is a build error.
RUN python -c "from kvconductor.kernel import KERNEL, STATUS; assert KERNEL, STATUS; print(STATUS)"
COPY config/ /etc/kvconductor/
# Listen on every interface inside the container; logs as JSON lines.
ENV KVCONDUCTOR_HTTP_HOST=0.0.0.0 \
    KVCONDUCTOR_LOG_FORMAT=json \
    PYTHONUNBUFFERED=1
USER kvconductor
EXPOSE 8787 8788
CMD ["kvconductor", "run", "--config", "/etc/kvconductor/kvconductor.toml"]
