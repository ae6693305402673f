# syntax=docker/dockerfile:1
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o /out/kube-userspace-proxy ./cmd/kube-userspace-proxy

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables=1.8.* \
 && rm -rf /var/lib/apt/lists/* \
 && update-alternatives --set iptables /usr/sbin/iptables-nft \
 && update-alternatives --set ip6tables /usr/sbin/ip6tables-nft
COPY --from=build /out/kube-userspace-proxy /usr/local/bin/kube-userspace-proxy
ENTRYPOINT ["/usr/local/bin/kube-userspace-proxy"]
