// Small socket helpers shared by the store, the launcher and the Gloo communicator. IPv4 only:
// the clusters kiln targets address nodes by IPv4 and it keeps the store's code small.
#pragma once

#include <netinet/in.h>

#include <string>

namespace kiln {

// Resolves `host` (a name or dotted quad) to an IPv4 address. Throws InputError naming it.
sockaddr_in resolve_ipv4(const std::string& host, int port);
// The address of this machine's interface that routes toward `host` (no packet is sent):
// what peers on the same network should use to reach us. "127.0.0.1" for a loopback host.
std::string local_address_toward(const std::string& host);
// "a.b.c.d:port" of a socket address.
std::string address_str(const sockaddr_in& addr);
// strerror(errno) as a string, thread-safe.
std::string errno_str(int err);

}  // namespace kiln
