#!/usr/bin/env python3
"""The demo's outside world for domain rules: on ADDR, a DNS server (UDP 53) that
answers allowed.test and evil.test with ADDR (NXDOMAIN for the rest, each query
logged), and an HTTPS server (443, CERT and KEY) that answers with the server
name the client's hello carried.

    demo-outside.py ADDR CERT KEY
"""
import http.server
import socket
import ssl
import struct
import sys
import threading

addr, cert, key = sys.argv[1:4]
names = {"allowed.test", "evil.test"}


def dns():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((addr, 53))
    while True:
        q, peer = s.recvfrom(512)
        ident, flags, qd = struct.unpack(">HHH", q[:6])
        i, labels = 12, []
        while q[i]:
            labels.append(q[i + 1 : i + 1 + q[i]].decode())
            i += 1 + q[i]
        question = q[12 : i + 5]
        qtype = struct.unpack(">H", q[i + 1 : i + 3])[0]
        name = ".".join(labels).lower()
        print(f"outside DNS: asked {name}", file=sys.stderr, flush=True)
        known = name in names
        answer = b""
        if known and qtype == 1:
            answer = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton(addr)
        rcode = 0 if known else 3
        head = struct.pack(">HHHHHH", ident, 0x8180 | rcode, 1, 1 if answer else 0, 0, 0)
        s.sendto(head + question + answer, peer)


class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"hello from the server of {getattr(self.request, 'dsec_sni', None)}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)


def remember(sock, name, _):
    sock.dsec_sni = name


ctx.sni_callback = remember
web = http.server.ThreadingHTTPServer((addr, 443), Hello)
web.socket = ctx.wrap_socket(web.socket, server_side=True)
threading.Thread(target=dns, daemon=True).start()
web.serve_forever()
