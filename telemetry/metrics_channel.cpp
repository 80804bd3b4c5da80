#include "telemetry/metrics_channel.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "base/error.h"
#include "dist/launcher.h"

namespace kiln {

std::string encode_report(const RankReport& r) {
  std::string s = "rank " + std::to_string(r.rank) + "\n";
  char buf[64];
  for (const auto& [key, value] : r.values) {
    std::snprintf(buf, sizeof buf, " %.17g\n", value);
    s += key + buf;
  }
  return s;
}

std::optional<RankReport> decode_report(const std::string& datagram) {
  std::istringstream in(datagram);
  std::string word;
  RankReport r;
  if (!(in >> word >> r.rank) || word != "rank" || r.rank < 0) return std::nullopt;
  std::string key, value;
  while (in >> key >> value) {
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (end == value.c_str() || *end != '\0') return std::nullopt;
    r.values.emplace_back(key, v);
  }
  return r;
}

MetricsSocketPair make_metrics_socket_pair() {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, fds) != 0)
    throw std::runtime_error(std::string("metrics channel: socketpair: ") + std::strerror(errno));
  // The workers' end survives their exec.
  if (::fcntl(fds[1], F_SETFD, 0) != 0)
    throw std::runtime_error(std::string("metrics channel: fcntl: ") + std::strerror(errno));
  return {fds[0], fds[1]};
}

std::vector<RankReport> receive_reports(int launcher_fd) {
  std::vector<RankReport> out;
  std::string buf(64 * 1024, '\0');
  for (;;) {
    const ssize_t n = ::recv(launcher_fd, buf.data(), buf.size(), MSG_DONTWAIT);
    if (n < 0) break;  // EAGAIN: none left (any other error: nothing to read either)
    if (auto r = decode_report(buf.substr(0, static_cast<size_t>(n)))) out.push_back(*r);
  }
  return out;
}

std::optional<int> metrics_fd_from_environment() {
  const char* v = std::getenv(kMetricsFdVariable);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  const long fd = std::strtol(v, &end, 10);
  struct stat st {};
  if (*end != '\0' || fd < 0 || fd > 1 << 20 || ::fstat(static_cast<int>(fd), &st) != 0 ||
      !S_ISSOCK(st.st_mode))
    throw InputError(std::string(kMetricsFdVariable) + "=" + v +
                     " is not an open socket (it is set by kiln's launcher for its workers)");
  return static_cast<int>(fd);
}

void send_report(int worker_fd, const RankReport& r) {
  const std::string s = encode_report(r);
  // MSG_NOSIGNAL: a launcher gone is the launcher's business (PDEATHSIG ends us), not a SIGPIPE.
  (void)::send(worker_fd, s.data(), s.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

}  // namespace kiln
