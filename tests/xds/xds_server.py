"""A small xDS v3 control plane for the xDS source's real-component tests (tests/tests/xds_real.rs).

Serves ClusterLoadAssignments over gRPC on 127.0.0.1: AggregatedDiscoveryService and
EndpointDiscoveryService, state of the world and delta; and over REST-JSON
(POST /v3/discovery:endpoints) on the control port. The test drives it through the control
port (HTTP/1.1, JSON):

  POST /push     {"cluster": "web", "version": "2", "endpoints": [ENDPOINT, ...]}
                 ENDPOINT = {"address": "127.0.0.1", "port": 8080, "health": "HEALTHY",
                             "weight": 3, "priority": 0, "region": "eu", "zone": "eu-1",
                             "hostname": "a", "lb": {"version": "v1"},
                             "health_check_config": {"port_value": 9000}}
                 ("port": a string is a named_port, null or absent leaves the port unset;
                 "health": a number is sent as is, even outside the enum)
                 Nothing is validated: an invalid endpoint (port 0, "not-an-ip", weight 0)
                 goes out as is, for the client to NACK. An optional "policy" (proto3 JSON of
                 ClusterLoadAssignment.Policy) goes out as the assignment's policy.
  POST /push_raw {"version": "2", "resources": [RAW, ...]}
                 RAW = {"name": "web", "endpoints": [ENDPOINT, ...]} with optional
                       "cluster_name" (the assignment's own name; default: name),
                       "type_url" (the Any's type; default: ClusterLoadAssignment),
                       "value_hex" (raw Any bytes instead of an assignment),
                       "no_body": true (delta: a Resource without its resource)
                 Sends exactly these resources, in this order and duplicates included, on
                 every stream (SotW: the response's resources; delta: added resources named
                 "name" at "version") until the next /push.
  POST /remove   {"cluster": "web"}   delta: removed_resources; SotW: omitted from responses
  POST /drop     {}                   ends every open gRPC stream with UNAVAILABLE
  POST /push_resources {"type": "cluster" | "listener" | "route", "version": "2", "resources": [RES, ...]}
                 RES = an envoy.config.cluster.v3.Cluster, envoy.config.listener.v3.Listener or
                       envoy.config.route.v3.RouteConfiguration in proto3 JSON (snake_case names
                       accepted; typed_config with "@type")
                 The whole set of that type from now on, served over ADS to streams that
                 subscribed the type: SotW sends it as one response (duplicates included);
                 delta sends the resources whose content changed (each keeps the version it
                 was last changed at) and removes the names that left the set. Clusters and
                 listeners are wildcard subscriptions; routes are served by name, as EDS: only
                 the names the stream asks for (SotW: the request's resource_names, answered
                 again whenever they change; delta: resource_names_subscribe / _unsubscribe).
  GET  /requests                      every request received, oldest first (see record()); each
                                      names its stream (numbered from 1 as they open) and its
                                      time ("t", CLOCK_MONOTONIC seconds)

--replay FILE (the fleet harness's server restart): a JSON list of {"path": "/push" ...,
"body": {...}} control calls applied in order before the gRPC port listens, so a restarted
server serves the same resources at the same versions from its first stream on.

Prints "READY grpc=<port> control=<port>" on stdout once both listen (on 127.0.0.1, or on
--host). Stops on SIGTERM/SIGKILL
or when stdin closes.

TLS (tests/tests/xds_tls.rs): with --tls-cert and --tls-key (PEM files) the gRPC port serves
TLS only (grpcio's ssl_server_credentials), and a third port serves REST EDS over TLS (the
control port stays plaintext for the test); with --tls-client-ca too, both require a client
certificate signed by that CA. The READY line then ends with " rest=<port>".
"""

import argparse
import json
import queue
import ssl
import sys
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from google.protobuf import any_pb2, json_format, wrappers_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import health_check_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2  # noqa: F401 (registers the type for "@type")
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2  # noqa: F401 (registers the type for "@type")
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401 (registers the type for "@type")
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc

CLA_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
TYPED = {
    "cluster": (CLUSTER_TYPE, cluster_pb2.Cluster),
    "listener": (LISTENER_TYPE, listener_pb2.Listener),
    "route": (ROUTE_TYPE, route_pb2.RouteConfiguration),
}
STREAM_POLL_SECONDS = 0.2


class Store:
    """Snapshots, open streams and recorded requests, behind one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.resources = {}  # name -> (version, ClusterLoadAssignment)
        self.raw = None  # (version, [(name, Any or None)]) from /push_raw, until the next /push
        self.system_version = ""
        self.streams = []
        self.opened = 0
        self.requests = []
        self.nonce = 0
        # type URL -> (version, [(name, version changed at, message)]) from /push_resources
        self.typed = {}

    def next_nonce(self):
        with self.lock:
            self.nonce += 1
            return str(self.nonce)

    def record(self, kind, rpc, request, stream=0):
        detail = request.error_detail.message if request.HasField("error_detail") else None
        entry = {
            "kind": kind,
            "rpc": rpc,
            "stream": stream,
            "node": request.node.id,
            "identity": json_format.MessageToDict(request.node, preserving_proto_field_name=True),
            "type_url": request.type_url,
            "response_nonce": request.response_nonce,
            "error_detail": detail,
            "t": time.monotonic(),
        }
        if kind == "delta":
            entry["subscribe"] = list(request.resource_names_subscribe)
            entry["unsubscribe"] = list(request.resource_names_unsubscribe)
            entry["initial_resource_versions"] = dict(request.initial_resource_versions)
        else:
            entry["version_info"] = request.version_info
            entry["resource_names"] = list(request.resource_names)
        with self.lock:
            self.requests.append(entry)

    def push(self, name, version, cla):
        with self.lock:
            self.resources[name] = (version, cla)
            self.system_version = version
            self.raw = None
            streams = list(self.streams)
        for stream in streams:
            stream.put(("changed", name))

    def push_raw(self, version, resources):
        with self.lock:
            self.raw = (version, resources)
            self.system_version = version
            streams = list(self.streams)
        for stream in streams:
            stream.put(("raw", None))

    def remove(self, name):
        with self.lock:
            self.resources.pop(name, None)
            streams = list(self.streams)
        for stream in streams:
            stream.put(("removed", name))

    def push_typed(self, kind, version, specs):
        type_url, message = TYPED[kind]
        parsed = [json_format.ParseDict(spec, message()) for spec in specs]
        with self.lock:
            before = {n: (v, m) for n, v, m in self.typed.get(type_url, ("", []))[1]}
            entries = []
            for item in parsed:
                held = before.get(item.name)
                changed_at = held[0] if held is not None and held[1] == item else version
                entries.append((item.name, changed_at, item))
            self.typed[type_url] = (version, entries)
            streams = list(self.streams)
        for stream in streams:
            stream.put(("typed", type_url))

    def drop(self):
        with self.lock:
            streams = list(self.streams)
        for stream in streams:
            stream.put(("drop", None))


def build_cla(name, endpoints):
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    localities = {}
    for spec in endpoints:
        key = (spec.get("priority", 0), spec.get("region", ""), spec.get("zone", ""))
        if key not in localities:
            locality = cla.endpoints.add(priority=key[0])
            locality.locality.region, locality.locality.zone = key[1], key[2]
            localities[key] = locality
        lb = localities[key].lb_endpoints.add()
        socket = lb.endpoint.address.socket_address
        socket.address = spec["address"]
        port = spec.get("port")
        if isinstance(port, str):
            socket.named_port = port
        elif port is not None:
            socket.port_value = port
        lb.endpoint.hostname = spec.get("hostname", "")
        if "health_check_config" in spec:
            json_format.ParseDict(spec["health_check_config"], lb.endpoint.health_check_config)
        health = spec.get("health", "UNKNOWN")
        lb.health_status = health if isinstance(health, int) else health_check_pb2.HealthStatus.Value(health)
        if "weight" in spec:
            lb.load_balancing_weight.CopyFrom(wrappers_pb2.UInt32Value(value=spec["weight"]))
        for key_name, value in spec.get("lb", {}).items():
            lb.metadata.filter_metadata["envoy.lb"][key_name] = value
    return cla


def build_raw(spec):
    """One RAW entry of /push_raw as (name, Any or None)."""
    name = spec["name"]
    if spec.get("no_body"):
        return name, None
    packed = any_pb2.Any()
    if "value_hex" in spec:
        packed.type_url, packed.value = CLA_TYPE, bytes.fromhex(spec["value_hex"])
    else:
        packed.Pack(build_cla(spec.get("cluster_name", name), spec.get("endpoints", [])))
    if "type_url" in spec:
        packed.type_url = spec["type_url"]
    return name, packed


class Servicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer, eds_pb2_grpc.EndpointDiscoveryServiceServicer):
    def __init__(self, store):
        self.store = store

    def StreamAggregatedResources(self, request_iterator, context):
        return self.sotw("ads", request_iterator, context)

    def StreamEndpoints(self, request_iterator, context):
        return self.sotw("eds", request_iterator, context)

    def DeltaAggregatedResources(self, request_iterator, context):
        return self.delta("ads", request_iterator, context)

    def DeltaEndpoints(self, request_iterator, context):
        return self.delta("eds", request_iterator, context)

    def open(self, kind, rpc, request_iterator):
        events = queue.Queue()
        with self.store.lock:
            self.store.streams.append(events)
            self.store.opened += 1
            stream = self.store.opened

        def read():
            try:
                for request in request_iterator:
                    self.store.record(kind, rpc, request, stream)
                    if request.type_url == CLA_TYPE:
                        events.put(("request", request))
                    elif request.type_url in (CLUSTER_TYPE, LISTENER_TYPE, ROUTE_TYPE):
                        events.put(("typed_request", request))
            except grpc.RpcError:
                pass
            events.put(("end", None))

        threading.Thread(target=read, daemon=True).start()
        return events

    def close(self, events):
        with self.store.lock:
            self.store.streams.remove(events)

    def sotw(self, rpc, request_iterator, context):
        events = self.open("sotw", rpc, request_iterator)
        # typed: type URL -> the names asked (None: wildcard).
        names, sent_version, typed = set(), None, {}
        try:
            while context.is_active():
                try:
                    event, value = events.get(timeout=STREAM_POLL_SECONDS)
                except queue.Empty:
                    continue
                if event == "end":
                    return
                if event == "drop":
                    context.abort(grpc.StatusCode.UNAVAILABLE, "dropped by the test")
                if event in ("typed_request", "typed"):
                    # Clusters and listeners: a first request subscribes its type; a push sends
                    # the type's whole set to the streams that subscribed it.
                    type_url = value.type_url if event == "typed_request" else value
                    if event == "typed_request" and type_url == ROUTE_TYPE:
                        # By name: answered again only when the names change.
                        asked = set(value.resource_names)
                        if typed.get(type_url) == asked:
                            continue
                        typed[type_url] = asked
                    elif event == "typed_request":
                        if value.response_nonce:
                            continue
                        typed[type_url] = None
                    response = self.typed_sotw(type_url, typed[type_url]) if type_url in typed else None
                    if response is not None:
                        yield response
                    continue
                if event == "request":
                    # An ACK or NACK names what the client holds; only a change of the names
                    # (a client adding or removing clusters on the stream) asks for more.
                    if value.response_nonce and set(value.resource_names) == names:
                        continue
                    added = set(value.resource_names) - names
                    names = set(value.resource_names)
                    if value.response_nonce and not added:
                        continue
                    if value.response_nonce:
                        # The stream's resources again, the new ones included.
                        sent_version = None
                    else:
                        sent_version = value.version_info
                elif event != "raw" and value not in names:
                    continue
                response = self.sotw_response(names)
                if response is not None and (event != "request" or response.version_info != sent_version):
                    sent_version = response.version_info
                    yield response
        finally:
            self.close(events)

    def sotw_response(self, names):
        with self.store.lock:
            held = {n: r for n, r in self.store.resources.items() if n in names}
            version = self.store.system_version
            raw = self.store.raw
        if not version:
            return None
        response = discovery_pb2.DiscoveryResponse(version_info=version, type_url=CLA_TYPE, nonce=self.store.next_nonce())
        if raw is not None:
            for _, packed in raw[1]:
                response.resources.add().CopyFrom(packed if packed is not None else any_pb2.Any())
            return response
        for name in sorted(held):
            response.resources.add().Pack(held[name][1])
        return response

    def typed_sotw(self, type_url, wanted):
        """The set of `type_url`; only the names in `wanted` unless it is None (wildcard)."""
        with self.store.lock:
            version, entries = self.store.typed.get(type_url, ("", []))
        if not version or wanted == set():
            return None
        response = discovery_pb2.DiscoveryResponse(version_info=version, type_url=type_url, nonce=self.store.next_nonce())
        for name, _, message in entries:
            if wanted is None or name in wanted:
                response.resources.add().Pack(message)
        return response

    def typed_delta(self, type_url, known, wanted):
        """What changed of `type_url` since `known` (name -> version, updated); only the names
        in `wanted` unless it is None (wildcard)."""
        with self.store.lock:
            version, entries = self.store.typed.get(type_url, ("", []))
        if not version:
            return None
        entries = [e for e in entries if wanted is None or e[0] in wanted]
        response = discovery_pb2.DeltaDiscoveryResponse(type_url=type_url, system_version_info=version)
        for name, changed_at, message in entries:
            if known.get(name) != changed_at:
                known[name] = changed_at
                response.resources.add(name=name, version=changed_at).resource.Pack(message)
        current = {name for name, _, _ in entries}
        for name in sorted(set(known) - current):
            known.pop(name)
            response.removed_resources.append(name)
        if not response.resources and not response.removed_resources:
            return None
        response.nonce = self.store.next_nonce()
        return response

    def delta(self, rpc, request_iterator, context):
        events = self.open("delta", rpc, request_iterator)
        # typed: type URL -> name -> version held; wanted: ROUTE_TYPE -> the names subscribed.
        names, known, first, typed, wanted = set(), {}, True, {}, {}
        try:
            while context.is_active():
                try:
                    event, value = events.get(timeout=STREAM_POLL_SECONDS)
                except queue.Empty:
                    continue
                if event == "end":
                    return
                if event == "drop":
                    context.abort(grpc.StatusCode.UNAVAILABLE, "dropped by the test")
                if event in ("typed_request", "typed"):
                    type_url = value.type_url if event == "typed_request" else value
                    if event == "typed_request":
                        changes = list(value.resource_names_subscribe) + list(value.resource_names_unsubscribe)
                        if value.response_nonce and not changes:
                            continue
                        held = typed.setdefault(type_url, {})
                        held.update(value.initial_resource_versions)
                        if type_url == ROUTE_TYPE:
                            asked = wanted.setdefault(type_url, set())
                            asked |= set(value.resource_names_subscribe)
                            for name in value.resource_names_unsubscribe:
                                asked.discard(name)
                                held.pop(name, None)
                    response = self.typed_delta(type_url, typed[type_url], wanted.get(type_url)) if type_url in typed else None
                    if response is not None:
                        yield response
                    continue
                if event == "request":
                    if value.response_nonce:
                        continue
                    if first:
                        first = False
                        names = set(value.resource_names_subscribe)
                        known = dict(value.initial_resource_versions)
                        targets = names
                    else:
                        # Subscriptions changed on the open stream.
                        names |= set(value.resource_names_subscribe)
                        for name in value.resource_names_unsubscribe:
                            names.discard(name)
                            known.pop(name, None)
                        targets = set(value.resource_names_subscribe)
                elif event == "raw":
                    targets = None
                elif value in names:
                    targets = {value}
                else:
                    continue
                response = self.delta_response(targets, known, event == "removed")
                if response is not None:
                    yield response
        finally:
            self.close(events)

    def delta_response(self, targets, known, removed):
        response = discovery_pb2.DeltaDiscoveryResponse(type_url=CLA_TYPE)
        with self.store.lock:
            raw = self.store.raw if targets is None else None
            if raw is not None:
                version, entries = raw
                for name, packed in entries:
                    resource = response.resources.add(name=name, version=version)
                    known[name] = version
                    if packed is not None:
                        resource.resource.CopyFrom(packed)
            for name in sorted(targets or ()):
                if removed:
                    response.removed_resources.append(name)
                    known.pop(name, None)
                elif name in self.store.resources:
                    version, cla = self.store.resources[name]
                    if known.get(name) == version:
                        continue
                    known[name] = version
                    resource = response.resources.add(name=name, version=version)
                    resource.resource.Pack(cla)
            response.system_version_info = self.store.system_version
        if not response.resources and not response.removed_resources:
            return None
        response.nonce = self.store.next_nonce()
        return response


def apply(store, path, args):
    """One control call (POST `path` with JSON `args`); False when the path is unknown."""
    if path == "/push":
        cla = build_cla(args["cluster"], args["endpoints"])
        if "policy" in args:
            json_format.ParseDict(args["policy"], cla.policy)
        store.push(args["cluster"], args["version"], cla)
    elif path == "/push_raw":
        store.push_raw(args["version"], [build_raw(spec) for spec in args["resources"]])
    elif path == "/remove":
        store.remove(args["cluster"])
    elif path == "/push_resources":
        store.push_typed(args["type"], args["version"], args["resources"])
    elif path == "/drop":
        store.drop()
    else:
        return False
    return True


def control_handler(store):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status, body):
            data = body.encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/requests":
                with store.lock:
                    self.reply(200, json.dumps(store.requests))
            else:
                self.reply(404, "{}")

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.path == "/v3/discovery:endpoints":
                return self.rest(body)
            args = json.loads(body or b"{}")
            if not apply(store, self.path, args):
                return self.reply(404, "{}")
            self.reply(200, "{}")

        def rest(self, body):
            request = json_format.Parse(body, discovery_pb2.DiscoveryRequest())
            store.record("rest", "rest", request)
            with store.lock:
                held = {n: r for n, r in store.resources.items() if n in request.resource_names}
                version = store.system_version
            response = discovery_pb2.DiscoveryResponse(version_info=version, type_url=CLA_TYPE, nonce=store.next_nonce())
            for name in sorted(held):
                response.resources.add().Pack(held[name][1])
            self.reply(200, json_format.MessageToJson(response))

    return Handler


def read(path):
    with open(path, "rb") as f:
        return f.read()


def grpc_port(server, args):
    """Binds the gRPC port: plaintext, or TLS with the --tls-* files."""
    address = f"{args.host}:{args.grpc_port}"
    if not args.tls_cert:
        return server.add_insecure_port(address)
    client_ca = read(args.tls_client_ca) if args.tls_client_ca else None
    credentials = grpc.ssl_server_credentials(
        [(read(args.tls_key), read(args.tls_cert))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )
    return server.add_secure_port(address, credentials)


def rest_tls_server(store, args):
    """The REST (and control) handler behind TLS on its own port; a failed handshake only
    drops that connection."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(args.tls_cert, args.tls_key)
    if args.tls_client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(args.tls_client_ca)
    rest = ThreadingHTTPServer(("127.0.0.1", 0), control_handler(store))
    rest.socket = context.wrap_socket(rest.socket, server_side=True)
    threading.Thread(target=rest.serve_forever, daemon=True).start()
    return rest


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address of the gRPC and control ports (the fleet harness, in a namespace of its own, listens on 0.0.0.0)")
    parser.add_argument("--grpc-port", type=int, default=0)
    parser.add_argument("--control-port", type=int, default=0)
    parser.add_argument("--tls-cert", help="server certificate chain (PEM): serve TLS")
    parser.add_argument("--tls-key", help="server private key (PEM)")
    parser.add_argument("--tls-client-ca", help="require client certificates signed by this CA")
    parser.add_argument("--replay", help="JSON list of control calls applied before listening")
    args = parser.parse_args()
    store = Store()
    if args.replay:
        with open(args.replay) as f:
            for call in json.load(f):
                if not apply(store, call["path"], call["body"]):
                    sys.exit(f"--replay: unknown path {call['path']!r}")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    servicer = Servicer(store)
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(servicer, server)
    eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(servicer, server)
    port = grpc_port(server, args)
    server.start()
    control = ThreadingHTTPServer((args.host, args.control_port), control_handler(store))
    threading.Thread(target=control.serve_forever, daemon=True).start()
    ready = f"READY grpc={port} control={control.server_address[1]}"
    rest = rest_tls_server(store, args) if args.tls_cert else None
    if rest:
        ready += f" rest={rest.server_address[1]}"
    print(ready, flush=True)
    sys.stdin.read()  # until the test closes stdin or kills us
    server.stop(0)
    control.shutdown()
    if rest:
        rest.shutdown()


if __name__ == "__main__":
    main()
