"""Prints, as JSON, what the process it runs in can reach: its network interfaces and whether a UDP socket
can be connected to an address outside the machine (192.0.2.1, TEST-NET-1: connecting a UDP socket sends
nothing, it only asks the kernel for a route). Run as a build action (//tests/hostile:network_probe) and by
network_test itself, outside any sandbox, as the control."""

import json
import socket


def probe() -> dict:
    result = {"interfaces": sorted(name for _, name in socket.if_nameindex())}
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.connect(("192.0.2.1", 9))
        result["outside"] = "connected"
    except OSError as e:
        result["outside"] = f"refused: {e.strerror or e}"
    finally:
        sock.close()
    return result


if __name__ == "__main__":
    print(json.dumps(probe(), sort_keys=True))
