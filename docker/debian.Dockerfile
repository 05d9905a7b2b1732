# Redis and Prometheus from Debian's packages, standing in for the registry
# images docker-compose.yml names, on machines that reach no image registry
# (docker-compose.debian.yml). Debian packages no Grafana.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS redis
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* /var/log/*
USER redis
# docker-compose.yml gives redis-server its arguments.
CMD ["redis-server"]

FROM ${BASE_IMAGE} AS prometheus
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* /var/log/* \
    && install -d -o nobody /prometheus
# As prom/prometheus: its user, its data a volume (docker-compose.yml mounts a tmpfs there), its flags.
USER nobody
VOLUME /prometheus
ENTRYPOINT ["prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
