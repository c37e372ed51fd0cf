# The clickagg image: `clickagg run` by default; any other subcommand works too
# (`docker run IMAGE migrate`, `... produce --count 1000`, `... config`).
# Used by docker-compose.yml; tests/it/deploy.rs checks that its ENV settings load.

# --- build ----------------------------------------------------------------------
FROM rust:1-bookworm AS build

# rdkafka-sys builds the bundled librdkafka with CMake (C compiler, make, cmake), with
# zstd and a static libcurl built from source too; the "ssl" feature and native-tls
# link OpenSSL, found through pkg-config; librdkafka's zlib support links zlib. Most of these are already in the base image:
# naming them keeps the build working if the base image slims down.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake pkg-config libssl-dev zlib1g-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src

# Dependencies first, with placeholder sources: this layer (the slow part, librdkafka
# included) is rebuilt only when Cargo.toml or Cargo.lock change, not on every edit.
COPY Cargo.toml Cargo.lock ./
RUN mkdir src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src

# The real sources. sql/ and assets/ are needed at compile time: src/sink.rs embeds
# the migrations with include_str!("../sql/..."), and the HTTP server the status page
# (assets/status.html). The touch matters: COPY keeps the files' old
# modification times, which can be older than the placeholder build, and cargo would
# then keep the placeholder binary.
# build.rs labels clickagg_build_info with the rustc version, and with the commit when
# given one: the context has no .git (`docker build --build-arg CLICKAGG_GIT_SHA=$(git
# rev-parse HEAD) .`); without it the metric carries the version alone.
ARG CLICKAGG_GIT_SHA=""
COPY build.rs ./
COPY src src
COPY sql sql
COPY assets assets
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked \
    && cp target/release/clickagg /usr/local/bin/clickagg

# --- runtime --------------------------------------------------------------------
FROM debian:bookworm-slim

# libssl3 for OpenSSL (Kafka TLS, rediss://, https:// ClickHouse), ca-certificates to
# verify servers, curl for the compose health check on /readyz. zlib and libgcc come
# with the base image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libssl3 curl \
    && rm -rf /var/lib/apt/lists/*

# Not root: the aggregator needs no privileges. The home directory is the working
# directory, where `clickagg produce` writes its ground truth (truth.csv).
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /var/lib/clickagg clickagg

COPY --from=build /usr/local/bin/clickagg /usr/local/bin/clickagg

USER 10001:10001
WORKDIR /var/lib/clickagg

# The default http.addr is 127.0.0.1:9464, unreachable from outside a container:
# listen on every interface so health checks and Prometheus can reach
# /livez, /readyz and /metrics.
ENV CLICKAGG__HTTP__ADDR=0.0.0.0:9464
EXPOSE 9464

# clickagg handles SIGTERM itself (final flush and commit within
# pipeline.drain_timeout), so it runs as PID 1 without a shell in between.
ENTRYPOINT ["clickagg"]
CMD ["run"]
