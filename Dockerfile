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

FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvconductor ./kvconductor
COPY consumers ./consumers
# Wheels of kvconductor and of every dependency, so the runtime stage needs no compiler.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.12-slim
RUN useradd --system --uid 10001 --no-create-home kvconductor
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels kvconductor && rm -rf /wheels
COPY config/ /etc/kvconductor/
# Listen on every interface inside the container; logs as JSON lines.
ENV KVCONDUCTOR_HTTP_HOST=0.0.0.0 \
    KVCONDUCTOR_LOG_FORMAT=json \
    PYTHONUNBUFFERED=1
USER kvconductor
EXPOSE 8787 8788
CMD ["kvconductor", "run", "--config", "/etc/kvconductor/kvconductor.toml"]
