# syntax=docker/dockerfile:1
# NestQuant Serve images: one build stage, one slim runtime image per service.
#
#   docker build --target router   -t nestquant/router:dev .
#   docker build --target streamer -t nestquant/streamer:dev .
#   docker build --target worker   -t nestquant/worker:dev .
#   docker build --target tools    -t nestquant/tools:dev .     # `nq` + the embedded model
#
# (`docker compose -f deploy/compose.yaml build` builds all four.) The build stage runs the
# README's own steps: scripts/setup.sh, then the CMake `cuda` preset where the CUDA toolkit
# is installed (/usr/local/cuda/bin/nvcc), the `cpu` preset otherwise. For CUDA images name
# the toolkit and runtime packages of NVIDIA's Debian 12 repository, e.g.
#   --build-arg CUDA_TOOLKIT="cuda-toolkit-12-8 libnccl-dev" \
#   --build-arg CUDA_RUNTIME="cuda-cudart-12-8 libcublas-12-8 libnccl2"
# Runtime images run as uid/gid 10001 (`nq`) in every service: the worker's shared-memory
# slot arenas are 0600, so the streamer must run as the same user to map them.

ARG DEBIAN_IMAGE=debian:12
ARG RUNTIME_IMAGE=debian:12-slim
ARG CUDA_KEYRING_URL=https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb

# ---------------------------------------------------------------------------------------------
FROM ${DEBIAN_IMAGE} AS build
ARG CUDA_TOOLKIT=""
ARG CUDA_KEYRING_URL
ENV DEBIAN_FRONTEND=noninteractive
WORKDIR /src
RUN if [ -n "$CUDA_TOOLKIT" ]; then \
      apt-get update -q && apt-get install -y -q --no-install-recommends ca-certificates curl && \
      curl -fsSL -o /tmp/cuda-keyring.deb "$CUDA_KEYRING_URL" && dpkg -i /tmp/cuda-keyring.deb && \
      apt-get update -q && apt-get install -y -q --no-install-recommends $CUDA_TOOLKIT && \
      rm -rf /var/lib/apt/lists/* /tmp/cuda-keyring.deb; \
    fi
# setup.sh and the package lists it installs from first, so this layer is cached across
# source changes.
COPY scripts/setup.sh scripts/setup.sh
COPY tests/e2e/package.json tests/e2e/package-lock.json tests/e2e/
COPY tests/deploy/package.json tests/deploy/package-lock.json tests/deploy/
RUN bash scripts/setup.sh && rm -rf /var/lib/apt/lists/*
COPY . .
RUN if [ -x /usr/local/cuda/bin/nvcc ]; then preset=cuda; else preset=cpu; fi && \
    echo "building with the $preset preset" && \
    cmake --preset "$preset" -DNQ_BUILD_TESTS=OFF && \
    cmake --build --preset "$preset" -j "$(nproc)" --target nq-router nq-worker nq-streamer nq && \
    mkdir -p /out && \
    cp "build/$preset/services/router/nq-router" "build/$preset/services/worker/nq-worker" \
       "build/$preset/services/streamer/nq-streamer" "build/$preset/services/tools/nq" /out/ && \
    strip --strip-debug /out/*

# ---------------------------------------------------------------------------------------------
# The shared runtime: what the four binaries link against (RUNTIME_LIBS, Debian 12 package
# names; the ctest deploy_runtime_libs compares it with the packages that `ldd` finds for the
# binaries of the CPU preset), curl for the healthchecks, and the service user.
FROM ${RUNTIME_IMAGE} AS runtime
ARG CUDA_RUNTIME=""
ARG CUDA_KEYRING_URL
ARG RUNTIME_LIBS="libabsl20220623 libcpp-httplib0.11 libfmt9 libgrpc++1.51 libgrpc29 libicu72 libpcre2-8-0 libprotobuf32 libspdlog1.10 libssl3 liburing2 zlib1g"
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -q && \
    apt-get install -y -q --no-install-recommends $RUNTIME_LIBS ca-certificates curl && \
    if [ -n "$CUDA_RUNTIME" ]; then \
      curl -fsSL -o /tmp/cuda-keyring.deb "$CUDA_KEYRING_URL" && dpkg -i /tmp/cuda-keyring.deb && \
      apt-get update -q && apt-get install -y -q --no-install-recommends $CUDA_RUNTIME; \
    fi && \
    rm -rf /var/lib/apt/lists/* /tmp/cuda-keyring.deb && \
    groupadd --gid 10001 nq && \
    useradd --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin nq
USER 10001:10001
WORKDIR /tmp

# The healthchecks: each service's /health answers 200 only while it serves (grpc.health.v1
# SERVING); the port follows $NQ_HEALTH_PORT where a deployment moves it.

# ---------------------------------------------------------------------------------------------
FROM runtime AS streamer
COPY --from=build /out/nq-streamer /usr/local/bin/nq-streamer
EXPOSE 8200 8201
ENV NQ_HEALTH_PORT=8201
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD curl -fsS -o /dev/null "http://127.0.0.1:${NQ_HEALTH_PORT}/health" || exit 1
ENTRYPOINT ["/usr/local/bin/nq-streamer"]

FROM runtime AS worker
COPY --from=build /out/nq-worker /usr/local/bin/nq-worker
EXPOSE 8100 8101
ENV NQ_HEALTH_PORT=8101
# Loading a large model's shard takes minutes; failures inside the start period do not count.
HEALTHCHECK --interval=10s --timeout=3s --start-period=900s --retries=3 \
  CMD curl -fsS -o /dev/null "http://127.0.0.1:${NQ_HEALTH_PORT}/health" || exit 1
ENTRYPOINT ["/usr/local/bin/nq-worker"]

# `nq` and the embedded default (models/glm5_nano with scripts/embedded_model.sh, which
# calibrates and encodes its release on first start): the compose file's `cpu` profile runs
# it once to fill the model volume.
FROM runtime AS tools
COPY --from=build /out/nq /usr/local/bin/nq
COPY --chown=10001:10001 scripts/embedded_model.sh /opt/nestquant/scripts/embedded_model.sh
COPY --chown=10001:10001 models/glm5_nano /opt/nestquant/models/glm5_nano
USER root
# The volume mount point, owned by the service user so a fresh named volume inherits it.
RUN mkdir -p /models && chown 10001:10001 /models
USER 10001:10001
ENV NQ_BIN=/usr/local/bin/nq
ENTRYPOINT ["/usr/local/bin/nq"]

# The router last: the default target of a plain `docker build .`.
FROM runtime AS router
COPY --from=build /out/nq-router /usr/local/bin/nq-router
EXPOSE 8000 8001
ENV NQ_HEALTH_PORT=8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD curl -fsS -o /dev/null "http://127.0.0.1:${NQ_HEALTH_PORT}/health" || exit 1
ENTRYPOINT ["/usr/local/bin/nq-router"]
