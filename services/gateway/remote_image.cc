#include "services/gateway/remote_image.h"

#include <arpa/inet.h>
#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace vlm::gateway {
namespace {

constexpr char kComponent[] = "gateway";

// True when the first `bits` bits of `a` (byte array) equal those of `prefix`.
template <size_t N>
bool InPrefix(const std::array<uint8_t, 16>& a, const std::array<uint8_t, N>& prefix, int bits) {
  for (int i = 0; i < bits; ++i) {
    const int byte = i / 8;
    const uint8_t mask = static_cast<uint8_t>(0x80 >> (i % 8));
    if ((a[byte] & mask) != (prefix[byte] & mask)) return false;
  }
  return true;
}

AddressClass ClassifyV4(uint8_t a, uint8_t b, uint8_t c, uint8_t d) {
  if (a == 0) return AddressClass::kUnspecified;  // 0/8 "this network"
  if (a == 10) return AddressClass::kPrivate;
  if (a == 100 && (b & 0xc0) == 64) return AddressClass::kSharedCgnat;  // 100.64/10
  if (a == 127) return AddressClass::kLoopback;
  if (a == 169 && b == 254) return AddressClass::kLinkLocal;
  if (a == 172 && (b & 0xf0) == 16) return AddressClass::kPrivate;  // 172.16/12
  if (a == 192 && b == 0 && c == 0) return AddressClass::kReserved;  // IETF protocol assignments
  if (a == 192 && b == 0 && c == 2) return AddressClass::kDocumentation;
  if (a == 192 && b == 88 && c == 99) return AddressClass::kReserved;  // 6to4 relay anycast
  if (a == 192 && b == 168) return AddressClass::kPrivate;
  if (a == 198 && (b & 0xfe) == 18) return AddressClass::kBenchmarking;  // 198.18/15
  if (a == 198 && b == 51 && c == 100) return AddressClass::kDocumentation;
  if (a == 203 && b == 0 && c == 113) return AddressClass::kDocumentation;
  if ((a & 0xf0) == 224) return AddressClass::kMulticast;
  if (a == 255 && b == 255 && c == 255 && d == 255) return AddressClass::kBroadcast;
  if ((a & 0xf0) == 240) return AddressClass::kReserved;
  return AddressClass::kPublic;
}

AddressClass ClassifyV6(const std::array<uint8_t, 16>& x) {
  using P = std::array<uint8_t, 16>;
  const bool first10_zero = std::all_of(x.begin(), x.begin() + 10, [](uint8_t v) { return v == 0; });
  if (first10_zero && x[10] == 0xff && x[11] == 0xff) {  // ::ffff:a.b.c.d (IPv4-mapped)
    return ClassifyV4(x[12], x[13], x[14], x[15]);
  }
  if (first10_zero && x[10] == 0 && x[11] == 0) {
    const bool rest_zero = x[12] == 0 && x[13] == 0 && x[14] == 0;
    if (rest_zero && x[15] == 0) return AddressClass::kUnspecified;  // ::
    if (rest_zero && x[15] == 1) return AddressClass::kLoopback;     // ::1
    return AddressClass::kReserved;  // ::a.b.c.d, IPv4-compatible (deprecated)
  }
  // 64:ff9b::/96, the NAT64 well-known prefix: the translator reaches the embedded IPv4.
  if (InPrefix(x, P{0x00, 0x64, 0xff, 0x9b}, 96)) return ClassifyV4(x[12], x[13], x[14], x[15]);
  if (InPrefix(x, P{0x00, 0x64, 0xff, 0x9b, 0x00, 0x01}, 48)) return AddressClass::kReserved;
  if ((x[0] & 0xfe) == 0xfc) return AddressClass::kPrivate;  // fc00::/7 unique local
  if (x[0] == 0xfe && (x[1] & 0xc0) == 0x80) return AddressClass::kLinkLocal;  // fe80::/10
  if (x[0] == 0xfe && (x[1] & 0xc0) == 0xc0) return AddressClass::kPrivate;    // fec0::/10 site-local
  if (x[0] == 0xff) return AddressClass::kMulticast;
  // Only 2000::/3 is global unicast; inside it, the special ranges follow.
  if ((x[0] & 0xe0) != 0x20) return AddressClass::kReserved;
  if (x[0] == 0x20 && x[1] == 0x02) return ClassifyV4(x[2], x[3], x[4], x[5]);  // 6to4 2002::/16
  if (InPrefix(x, P{0x20, 0x01, 0x0d, 0xb8}, 32)) return AddressClass::kDocumentation;
  if (InPrefix(x, P{0x3f, 0xff}, 20)) return AddressClass::kDocumentation;
  if (InPrefix(x, P{0x20, 0x01, 0x00, 0x02, 0x00, 0x00}, 48)) return AddressClass::kBenchmarking;
  // 2001::/23, IETF protocol assignments: Teredo (2001::/32, the client's IPv4
  // is hidden), ORCHID, AMT ...
  if (InPrefix(x, P{0x20, 0x01, 0x00}, 23)) return AddressClass::kReserved;
  return AddressClass::kPublic;
}

bool IsHostChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_';
}

// The batch of one request: lets a failure or the deadline stop fetches in flight.
class FetchControl {
 public:
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  // Registers a client whose socket Cancel() shuts down; false if already cancelled.
  bool Register(httplib::ClientImpl* client) {
    absl::MutexLock lock(&mu_);
    if (cancelled()) return false;
    clients_.insert(client);
    return true;
  }
  void Unregister(httplib::ClientImpl* client) {
    absl::MutexLock lock(&mu_);
    clients_.erase(client);
  }
  void Cancel() {
    absl::MutexLock lock(&mu_);
    cancelled_.store(true, std::memory_order_release);
    // stop() shuts the socket down, so a blocked read returns at once.
    for (httplib::ClientImpl* c : clients_) c->stop();
  }

 private:
  absl::Mutex mu_;
  std::set<httplib::ClientImpl*> clients_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> cancelled_{false};
};

// Resolution on a detached thread: getaddrinfo has no timeout of its own.
// The thread owns its share of the state and ends on its own.
absl::StatusOr<std::vector<IpAddress>> ResolveBy(const std::string& host, absl::Time deadline,
                                                 const FetchControl* control) {
  struct Lookup {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    int rc ABSL_GUARDED_BY(mu) = 0;
    std::vector<IpAddress> addresses ABSL_GUARDED_BY(mu);
  };
  auto lookup = std::make_shared<Lookup>();
  try {
    std::thread([lookup, host] {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* result = nullptr;
      const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &result);
      std::vector<IpAddress> found;
      for (addrinfo* ai = result; rc == 0 && ai != nullptr; ai = ai->ai_next) {
        IpAddress ip;
        if (ai->ai_family == AF_INET) {
          const auto* sin = reinterpret_cast<const sockaddr_in*>(ai->ai_addr);
          std::memcpy(ip.bytes.data(), &sin->sin_addr, 4);
        } else if (ai->ai_family == AF_INET6) {
          const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(ai->ai_addr);
          ip.v6 = true;
          std::memcpy(ip.bytes.data(), &sin6->sin6_addr, 16);
        } else {
          continue;
        }
        if (std::find(found.begin(), found.end(), ip) == found.end()) found.push_back(ip);
      }
      if (result != nullptr) ::freeaddrinfo(result);
      absl::MutexLock lock(&lookup->mu);
      lookup->rc = rc;
      lookup->addresses = std::move(found);
      lookup->done = true;
    }).detach();
  } catch (const std::system_error& e) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host, ": ", e.what()));
  }
  absl::MutexLock lock(&lookup->mu);
  auto done = [&lookup]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(lookup->mu) { return lookup->done; };
  // In slices, so that a cancelled batch does not wait for a slow DNS server.
  while (!lookup->done && absl::Now() < deadline && (control == nullptr || !control->cancelled())) {
    lookup->mu.AwaitWithDeadline(absl::Condition(&done),
                                 std::min(deadline, absl::Now() + absl::Milliseconds(50)));
  }
  if (!lookup->done) {
    if (control != nullptr && control->cancelled()) return absl::CancelledError("cancelled");
    return absl::DeadlineExceededError(absl::StrCat("timed out resolving ", host));
  }
  if (lookup->rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", host, ": ", ::gai_strerror(lookup->rc)));
  }
  if (lookup->addresses.empty()) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host, ": no address"));
  }
  return lookup->addresses;
}

std::pair<time_t, time_t> SecondsAndMicros(absl::Duration d) {
  const int64_t us = std::max<int64_t>(1, absl::ToInt64Microseconds(d));
  return {static_cast<time_t>(us / 1000000), static_cast<time_t>(us % 1000000)};
}

bool IsRedirect(int status) {
  return status == 301 || status == 302 || status == 303 || status == 307 || status == 308;
}

// What one GET of one URL produced.
struct Hop {
  int status = 0;  // 0: no response
  std::string location;
  std::string body;
  bool too_large = false;
};

// One GET to `url` at exactly `ip`.
absl::StatusOr<Hop> Get(const ImageUrl& url, const IpAddress& ip, const RemoteImageOptions& options,
                        absl::Time deadline, FetchControl* control) {
  std::unique_ptr<httplib::ClientImpl> client;
  if (url.scheme == "https") {
    auto tls = std::make_unique<httplib::SSLClient>(url.host, url.port);
    // Verification (chain and the URL's host name) is on by default in cpp-httplib.
    tls->enable_server_certificate_verification(true);
    if (!options.ca_file.empty()) tls->set_ca_cert_path(options.ca_file);
    client = std::move(tls);
  } else {
    client = std::make_unique<httplib::ClientImpl>(url.host, url.port);
  }
  // The connection goes to the checked address, never to a second lookup of the name.
  client->set_hostname_addr_map({{url.host, ip.ToString()}});
  // A little past the deadline: cpp-httplib waits in whole milliseconds, and
  // a wait that ends just before the deadline would not read as a timeout.
  const auto [sec, usec] = SecondsAndMicros(deadline - absl::Now() + absl::Milliseconds(20));
  client->set_connection_timeout(sec, usec);
  client->set_read_timeout(sec, usec);
  client->set_write_timeout(sec, usec);
  client->set_follow_location(false);
  client->set_keep_alive(false);

  const bool default_port = url.port == (url.scheme == "https" ? 443 : 80);
  const std::string host =
      url.host.find(':') != std::string::npos ? absl::StrCat("[", url.host, "]") : url.host;
  httplib::Headers headers = {
      {"Host", default_port ? host : absl::StrCat(host, ":", url.port)},
      {"Accept", "image/jpeg, image/png, image/webp"},
      {"User-Agent", "vlm-gateway"},
  };
  if (control != nullptr && !control->Register(client.get())) {
    return absl::CancelledError("cancelled");
  }
  Hop hop;
  bool late = false;
  auto result = client->Get(
      url.target, headers,
      [&](const httplib::Response& response) {
        hop.status = response.status;
        if (control != nullptr && control->cancelled()) return false;
        if (IsRedirect(response.status)) {
          hop.location = response.get_header_value("Location");
          return false;  // the redirect's body is not needed
        }
        if (response.status != 200) return false;
        int64_t length = 0;
        if (response.has_header("Content-Length") &&
            absl::SimpleAtoi(response.get_header_value("Content-Length"), &length) &&
            length > options.max_bytes) {
          hop.too_large = true;
          return false;
        }
        return true;
      },
      [&](const char* data, size_t size) {
        hop.body.append(data, size);
        hop.too_large = static_cast<int64_t>(hop.body.size()) > options.max_bytes;
        late = absl::Now() >= deadline;
        return !hop.too_large && !late && (control == nullptr || !control->cancelled());
      });
  if (control != nullptr) control->Unregister(client.get());
  if (control != nullptr && control->cancelled()) return absl::CancelledError("cancelled");
  if (late || (!result && absl::Now() >= deadline)) return absl::DeadlineExceededError("timed out");
  if (hop.status != 0 && (result || result.error() == httplib::Error::Canceled)) return hop;
  const httplib::Error error = result.error();
  const std::string where = absl::StrCat(ip.v6 ? absl::StrCat("[", ip.ToString(), "]") : ip.ToString(),
                                         ":", url.port);
  // Unavailable only when no connection was made: the caller then tries the next address.
  switch (error) {
    case httplib::Error::Connection:
    case httplib::Error::ConnectionTimeout:
      return absl::UnavailableError(absl::StrCat("cannot connect to ", where));
    case httplib::Error::SSLConnection:
      return absl::AbortedError(absl::StrCat("TLS handshake with ", where, " failed"));
    case httplib::Error::SSLServerVerification:
      return absl::AbortedError(
          absl::StrCat("TLS certificate of ", url.host, " (", where, ") not trusted"));
    default:
      return absl::AbortedError(
          absl::StrCat("fetching from ", where, " failed: ", httplib::to_string(error)));
  }
}

absl::StatusOr<std::string> Fetch(const std::string& first_url, const RemoteImageOptions& options,
                                  absl::Time deadline, FetchControl* control) {
  std::string url_text = first_url;
  for (int redirects = 0;; ++redirects) {
    // A redirect's target is named in errors: the client only knows the first URL.
    const std::string shown = redirects == 0 ? url_text : absl::StrCat("redirected to ", url_text);
    absl::StatusOr<ImageUrl> url = ParseImageUrl(url_text);
    if (!url.ok()) {
      return absl::Status(url.status().code(), absl::StrCat(shown, ": ", url.status().message()));
    }
    std::vector<IpAddress> addresses;
    if (std::optional<IpAddress> literal = IpAddress::Parse(url->host)) {
      addresses.push_back(*literal);
    } else {
      absl::StatusOr<std::vector<IpAddress>> resolved =
          options.resolve ? options.resolve(url->host, deadline)
                          : ResolveBy(url->host, deadline, control);
      if (!resolved.ok()) {
        return absl::Status(resolved.status().code(),
                            absl::StrCat(shown, ": ", resolved.status().message()));
      }
      if (resolved->empty()) return absl::UnavailableError(absl::StrCat(shown, ": no address"));
      addresses = *std::move(resolved);
    }
    // Every address must pass, not only the one connected to.
    for (const IpAddress& ip : addresses) {
      const AddressClass c = ClassifyAddress(ip);
      if (AddressAllowed(c, options.allow_loopback)) continue;
      const std::string what =
          ip.ToString() == url->host
              ? absl::StrCat(ip.ToString(), " is ", AddressClassDescription(c))
              : absl::StrCat(url->host, " resolves to ", ip.ToString(), ", ",
                             AddressClassDescription(c));
      LogWarning(kComponent, "remote image refused",
                 {{"url", url_text}, {"address", ip.ToString()},
                  {"class", std::string(AddressClassDescription(c))}});
      return absl::PermissionDeniedError(
          absl::StrCat(shown, ": ", what, "; only public addresses are fetched"));
    }
    absl::StatusOr<Hop> hop = absl::UnavailableError("no address");
    for (const IpAddress& ip : addresses) {
      hop = Get(*url, ip, options, deadline, control);
      if (hop.ok() || !absl::IsUnavailable(hop.status())) break;  // else the next address
    }
    if (!hop.ok()) {
      if (absl::IsDeadlineExceeded(hop.status())) {
        return absl::DeadlineExceededError(absl::StrCat(
            shown, ": timed out (the images of a request must arrive within ",
            absl::FormatDuration(options.timeout), ")"));
      }
      return absl::Status(hop.status().code(), absl::StrCat(shown, ": ", hop.status().message()));
    }
    if (hop->too_large) {
      return absl::InvalidArgumentError(absl::StrCat(shown, ": the image is larger than ",
                                                     options.max_bytes, " bytes"));
    }
    if (IsRedirect(hop->status)) {
      if (hop->location.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(shown, " answered HTTP ", hop->status, " without a Location"));
      }
      if (redirects >= options.max_redirects) {
        return absl::InvalidArgumentError(
            absl::StrCat(first_url, ": more than ", options.max_redirects, " redirects"));
      }
      absl::StatusOr<std::string> next = ResolveRedirect(*url, hop->location);
      if (!next.ok()) {
        return absl::Status(next.status().code(),
                            absl::StrCat(shown, " redirects to \"", hop->location,
                                         "\": ", next.status().message()));
      }
      url_text = *std::move(next);
      continue;
    }
    if (hop->status != 200) {
      return absl::InvalidArgumentError(absl::StrCat(shown, " answered HTTP ", hop->status));
    }
    if (SniffImageType(hop->body).empty()) {
      return absl::InvalidArgumentError(absl::StrCat(shown, " is not a JPEG, PNG or WebP image"));
    }
    return std::move(hop->body);
  }
}

// The 1-based number of the image at messages[m].content[p] among the
// request's images, as the pipeline's "image N" messages count them.
int ImageNumber(const v1::ChatRequest& request, const RemoteImage& remote) {
  int n = 0;
  for (int i = 0; i < request.messages_size(); ++i) {
    for (int j = 0; j < request.messages(i).content_size(); ++j) {
      if (!request.messages(i).content(j).has_image()) continue;
      ++n;
      if (i == remote.message && j == remote.part) return n;
    }
  }
  return n;
}

ApiError ImageError(const OpenAiChatRequest& parsed, const RemoteImage& remote,
                    const absl::Status& status) {
  ApiError e;
  e.code = grpc::StatusCode::INVALID_ARGUMENT;
  e.param = remote.param;
  e.error_code = absl::IsPermissionDenied(status) ? "image_url_not_allowed" : "image_fetch_failed";
  e.message = absl::StrCat("image ", ImageNumber(parsed.request, remote), " (", remote.param,
                           "): ", status.message());
  return e;
}

}  // namespace

std::optional<IpAddress> IpAddress::Parse(absl::string_view text) {
  if (text.empty() || text.size() > INET6_ADDRSTRLEN) return std::nullopt;
  const std::string s(text);
  IpAddress ip;
  if (::inet_pton(AF_INET, s.c_str(), ip.bytes.data()) == 1) return ip;
  ip.v6 = true;
  if (::inet_pton(AF_INET6, s.c_str(), ip.bytes.data()) == 1) return ip;
  return std::nullopt;
}

std::string IpAddress::ToString() const {
  char text[INET6_ADDRSTRLEN] = {};
  ::inet_ntop(v6 ? AF_INET6 : AF_INET, bytes.data(), text, sizeof(text));
  return text;
}

AddressClass ClassifyAddress(const IpAddress& address) {
  const auto& b = address.bytes;
  return address.v6 ? ClassifyV6(b) : ClassifyV4(b[0], b[1], b[2], b[3]);
}

absl::string_view AddressClassDescription(AddressClass c) {
  switch (c) {
    case AddressClass::kPublic: return "a public address";
    case AddressClass::kLoopback: return "a loopback address";
    case AddressClass::kPrivate: return "a private address";
    case AddressClass::kLinkLocal: return "a link-local address";
    case AddressClass::kUnspecified: return "an unspecified address";
    case AddressClass::kMulticast: return "a multicast address";
    case AddressClass::kBroadcast: return "the broadcast address";
    case AddressClass::kSharedCgnat: return "a shared (carrier-grade NAT) address";
    case AddressClass::kDocumentation: return "a documentation address";
    case AddressClass::kBenchmarking: return "a benchmarking address";
    case AddressClass::kReserved: return "a reserved address";
  }
  return "an unknown address";
}

bool AddressAllowed(AddressClass c, bool allow_loopback) {
  return c == AddressClass::kPublic || (allow_loopback && c == AddressClass::kLoopback);
}

bool LoopbackImagesAllowedForTesting() {
  const char* value = std::getenv("VLM_TEST_ALLOW_LOOPBACK_IMAGES");
  const bool allowed = value != nullptr && absl::string_view(value) == "1";
  if (allowed) {
    static std::once_flag warned;
    std::call_once(warned, [] {
      LogWarning(kComponent,
                 "VLM_TEST_ALLOW_LOOPBACK_IMAGES=1: remote images may come from loopback "
                 "addresses (a test-only setting)");
    });
  }
  return allowed;
}

std::string ImageUrl::Origin() const {
  const bool v6 = host.find(':') != std::string::npos;
  return absl::StrCat(scheme, "://", v6 ? absl::StrCat("[", host, "]") : host, ":", port);
}

absl::StatusOr<ImageUrl> ParseImageUrl(absl::string_view url) {
  for (const char c : url) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f || c == '\\') {
      return absl::InvalidArgumentError(
          "the URL holds a space, backslash, control or non-ASCII character (percent-encode it)");
    }
  }
  const size_t colon = url.find("://");
  if (colon == absl::string_view::npos) return absl::InvalidArgumentError("not an absolute URL");
  ImageUrl out;
  out.scheme = absl::AsciiStrToLower(url.substr(0, colon));
  if (out.scheme != "http" && out.scheme != "https") {
    return absl::PermissionDeniedError(
        absl::StrCat("scheme \"", out.scheme, "\" is not fetched; only http and https"));
  }
  absl::string_view rest = url.substr(colon + 3);
  const size_t end = rest.find_first_of("/?#");
  absl::string_view authority = rest.substr(0, end);
  rest = end == absl::string_view::npos ? absl::string_view() : rest.substr(end);
  if (authority.find('@') != absl::string_view::npos) {
    return absl::InvalidArgumentError("user credentials in image URLs are not supported");
  }
  absl::string_view port;
  if (!authority.empty() && authority.front() == '[') {
    const size_t close = authority.find(']');
    if (close == absl::string_view::npos) return absl::InvalidArgumentError("unclosed '[' in host");
    std::optional<IpAddress> ip = IpAddress::Parse(authority.substr(1, close - 1));
    if (!ip.has_value() || !ip->v6) {
      return absl::InvalidArgumentError("the host in [...] is not an IPv6 address");
    }
    out.host = ip->ToString();
    absl::string_view after = authority.substr(close + 1);
    if (!after.empty() && after.front() != ':') {
      return absl::InvalidArgumentError("unexpected text after the IPv6 address");
    }
    if (!after.empty()) port = after.substr(1);
  } else {
    const size_t port_colon = authority.find(':');
    out.host = absl::AsciiStrToLower(authority.substr(0, port_colon));
    if (port_colon != absl::string_view::npos) port = authority.substr(port_colon + 1);
    if (out.host.empty()) return absl::InvalidArgumentError("the URL has no host");
    if (!std::all_of(out.host.begin(), out.host.end(), IsHostChar) || out.host.size() > 253) {
      return absl::InvalidArgumentError(absl::StrCat("\"", out.host, "\" is not a host name"));
    }
  }
  out.port = out.scheme == "https" ? 443 : 80;
  if (!port.empty()) {
    int n = 0;
    if (port.size() > 5 || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
        !absl::SimpleAtoi(port, &n) || n < 1 || n > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("port \"", port, "\" is not 1..65535"));
    }
    out.port = n;
  }
  rest = rest.substr(0, rest.find('#'));
  if (rest.empty() || rest.front() != '/') {
    out.target = absl::StrCat("/", rest);
  } else {
    out.target = std::string(rest);
  }
  return out;
}

absl::StatusOr<std::string> ResolveRedirect(const ImageUrl& base, absl::string_view location) {
  if (location.empty()) return absl::InvalidArgumentError("empty Location");
  // A scheme ("name:" before any '/', '?' or '#') makes an absolute URL;
  // ParseImageUrl refuses anything but http(s).
  const size_t colon = location.find(':');
  const size_t delimiter = location.find_first_of("/?#");
  if (colon != absl::string_view::npos && colon > 0 &&
      (delimiter == absl::string_view::npos || colon < delimiter) &&
      absl::ascii_isalpha(static_cast<unsigned char>(location[0]))) {
    return std::string(location);
  }
  if (location.size() >= 2 && location[0] == '/' && location[1] == '/') {
    return absl::StrCat(base.scheme, ":", location);
  }
  const std::string path = base.target.substr(0, base.target.find('?'));
  switch (location[0]) {
    case '/': return absl::StrCat(base.Origin(), location);
    case '?': return absl::StrCat(base.Origin(), path, location);
    case '#': return base.ToString();
    default: return absl::StrCat(base.Origin(), path.substr(0, path.rfind('/') + 1), location);
  }
}

absl::StatusOr<std::vector<IpAddress>> SystemResolve(const std::string& host, absl::Time deadline) {
  return ResolveBy(host, deadline, nullptr);
}

absl::StatusOr<std::string> FetchRemoteImage(const std::string& url,
                                             const RemoteImageOptions& options,
                                             absl::Time deadline) {
  return Fetch(url, options, deadline, nullptr);
}

std::optional<ApiError> FetchRemoteImages(const RemoteImageOptions& options,
                                          OpenAiChatRequest* parsed) {
  const std::vector<RemoteImage>& remotes = parsed->remote_images;
  const size_t n = remotes.size();
  if (n == 0) return std::nullopt;
  // The gateway refuses such a request anyway: fetching its images first would
  // let one request make the gateway send any number of fetches.
  int images = 0;
  for (const v1::ChatMessage& m : parsed->request.messages()) {
    for (const v1::ContentPart& p : m.content()) images += p.has_image() ? 1 : 0;
  }
  if (images > options.max_images) {
    ApiError e;
    e.code = grpc::StatusCode::INVALID_ARGUMENT;
    e.param = "messages";
    e.message = absl::StrCat("request has ", images, " images; max_images_per_request is ",
                             options.max_images);
    return e;
  }
  const absl::Time deadline = absl::Now() + options.timeout;

  struct Batch {
    absl::Mutex mu;
    size_t next ABSL_GUARDED_BY(mu) = 0;
    size_t finished ABSL_GUARDED_BY(mu) = 0;
    std::optional<size_t> failed ABSL_GUARDED_BY(mu);  // the first failure in time
    std::vector<std::optional<absl::StatusOr<std::string>>> results ABSL_GUARDED_BY(mu);
  } batch;
  {
    absl::MutexLock lock(&batch.mu);
    batch.results.resize(n);
  }
  FetchControl control;
  auto work = [&] {
    for (;;) {
      size_t i = 0;
      {
        absl::MutexLock lock(&batch.mu);
        if (control.cancelled() || batch.next >= n) return;
        i = batch.next++;
      }
      absl::StatusOr<std::string> r = Fetch(remotes[i].url, options, deadline, &control);
      const bool failure = !r.ok() && !absl::IsCancelled(r.status());
      {
        absl::MutexLock lock(&batch.mu);
        if (failure && !batch.failed.has_value()) batch.failed = i;
        batch.results[i] = std::move(r);
        ++batch.finished;
      }
      if (failure) control.Cancel();  // the request fails: the other fetches are of no use
    }
  };

  std::vector<std::thread> workers;
  const size_t parallel = std::min<size_t>(n, std::max(1, options.max_parallel));
  for (size_t k = 0; k < parallel; ++k) {
    try {
      workers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // fewer workers; at worst none, then this thread fetches
    }
  }
  if (workers.empty()) {
    work();
  } else {
    {
      absl::MutexLock lock(&batch.mu);
      auto settled = [&batch, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(batch.mu) {
        return batch.finished == n || batch.failed.has_value();
      };
      batch.mu.AwaitWithDeadline(absl::Condition(&settled), deadline);
    }
    control.Cancel();  // a no-op when every fetch has finished
    for (std::thread& t : workers) t.join();
  }

  absl::MutexLock lock(&batch.mu);
  if (batch.failed.has_value()) {
    return ImageError(*parsed, remotes[*batch.failed], batch.results[*batch.failed]->status());
  }
  for (size_t i = 0; i < n; ++i) {
    if (!batch.results[i].has_value() || !batch.results[i]->ok()) {  // stopped by the deadline
      return ImageError(*parsed, remotes[i],
                        absl::DeadlineExceededError(absl::StrCat(
                            remotes[i].url, ": timed out (the images of a request must arrive within ",
                            absl::FormatDuration(options.timeout), ")")));
    }
  }
  for (size_t i = 0; i < n; ++i) {
    parsed->request.mutable_messages(remotes[i].message)
        ->mutable_content(remotes[i].part)
        ->mutable_image()
        ->set_data(*std::move(*batch.results[i]));
  }
  return std::nullopt;
}

}  // namespace vlm::gateway
