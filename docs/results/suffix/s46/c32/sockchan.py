"""Prototype: a one-socket channel (TCP, one write per message, pickle 5 with out-of-band tensor buffers)."""

import pickle
import select
import socket
import struct
import time

_HDR = struct.Struct("<QQ")  # skeleton bytes, number of buffers


class SocketChannel:
    ordered = True

    def __init__(self, host, port, rank, timeout_s=120.0):
        if rank == 0:
            srv = socket.create_server((host, port))
            srv.settimeout(timeout_s)
            self.sock, _ = srv.accept()
            srv.close()
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    self.sock = socket.create_connection((host, port), timeout=timeout_s)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(timeout_s)

    def send(self, message):
        bufs = []
        data = pickle.dumps(message, protocol=5, buffer_callback=bufs.append)
        raws = [b.raw() for b in bufs]
        head = _HDR.pack(len(data), len(raws)) + b"".join(struct.pack("<Q", r.nbytes) for r in raws)
        parts = [memoryview(head), memoryview(data), *[memoryview(r).cast("B") for r in raws]]
        while parts:
            sent = self.sock.sendmsg(parts)
            while parts and sent >= parts[0].nbytes:
                sent -= parts[0].nbytes
                parts.pop(0)
            if parts and sent:
                parts[0] = parts[0][sent:]

    def expect(self):
        pass

    def _recv_exact(self, n):
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("peer closed")
            got += k
        return buf

    def recv(self, on_block=None):
        if on_block is not None and not select.select([self.sock], [], [], 0)[0]:
            on_block()
        n, nb = _HDR.unpack(self._recv_exact(_HDR.size))
        sizes = struct.unpack(f"<{nb}Q", self._recv_exact(8 * nb)) if nb else ()
        data = self._recv_exact(n)
        bufs = [self._recv_exact(s) for s in sizes]
        return pickle.loads(data, buffers=bufs)

    def close(self):
        self.sock.close()
