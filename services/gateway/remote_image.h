// Remote image URLs of HTTP chat requests (--allow_remote_images), fetched
// without letting a client reach the gateway's own network (SSRF):
//
// - Only http:// and https:// are fetched; user credentials, spaces, control
//   and non-ASCII characters in a URL are refused.
// - The host is resolved once by the fetcher itself; every resolved address is
//   classified (ClassifyAddress) and the URL is refused if any of them is not
//   a public unicast address: loopback, private, link-local (cloud metadata
//   169.254.169.254), unspecified, multicast, broadcast, CGNAT, documentation,
//   benchmarking and other reserved ranges, and their IPv4-mapped, NAT64 and
//   6to4 IPv6 forms. The connection then goes to exactly a checked address
//   (cpp-httplib's host -> address map: no second lookup, so no DNS
//   rebinding window), with the URL's host in Host and TLS SNI/verification.
// - Redirects are followed by hand (at most max_redirects), each hop parsed,
//   resolved and checked like the first URL.
// - A response must be 200 and at most max_bytes, arrive before the deadline,
//   and start like a JPEG, PNG or WebP image.
//
// The images of one request are fetched in parallel (at most max_parallel at
// once) within one deadline; results keep the request's order. The first
// failure cancels the others and becomes a 400 naming the image ("image 2
// (messages[0].content[3].image_url.url): ...") and the reason.
//
// Test-only: VLM_TEST_ALLOW_LOOPBACK_IMAGES=1 in the gateway's environment
// lets loopback addresses (127/8, ::1) through, so tests can serve images from
// 127.0.0.1. It is not a user setting: no flag sets it, and every other class
// stays refused.
//
// Thread-safety: free functions; FetchRemoteImages may run on many request
// threads at once.
#ifndef VLM_SERVICES_GATEWAY_REMOTE_IMAGE_H_
#define VLM_SERVICES_GATEWAY_REMOTE_IMAGE_H_

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "services/gateway/openai_protocol.h"

namespace vlm::gateway {

// An IPv4 or IPv6 address in network byte order (IPv4 uses bytes[0..3]).
struct IpAddress {
  bool v6 = false;
  std::array<uint8_t, 16> bytes{};

  // Dotted quad or RFC 4291 text (no brackets, no zone id); nullopt otherwise.
  static std::optional<IpAddress> Parse(absl::string_view text);
  std::string ToString() const;
  bool operator==(const IpAddress& o) const { return v6 == o.v6 && bytes == o.bytes; }
};

enum class AddressClass {
  kPublic,          // global unicast: the only class fetched
  kLoopback,        // 127/8, ::1
  kPrivate,         // 10/8, 172.16/12, 192.168/16, fc00::/7, fec0::/10 (site-local)
  kLinkLocal,       // 169.254/16 (cloud metadata), fe80::/10
  kUnspecified,     // 0.0.0.0/8 ("this network"), ::
  kMulticast,       // 224/4, ff00::/8
  kBroadcast,       // 255.255.255.255
  kSharedCgnat,     // 100.64/10
  kDocumentation,   // 192.0.2/24, 198.51.100/24, 203.0.113/24, 2001:db8::/32, 3fff::/20
  kBenchmarking,    // 198.18/15, 2001:2::/48
  kReserved,        // 240/4, 192.0.0/24, 192.88.99/24, other IPv6 outside 2000::/3 ...
};

// What `address` is. IPv6 forms that carry an IPv4 address a router or the
// kernel may act on (IPv4-mapped ::ffff:a.b.c.d, NAT64 64:ff9b::/96, 6to4
// 2002::/16) get the class of the embedded IPv4 address.
AddressClass ClassifyAddress(const IpAddress& address);

// "a loopback address", "a private address", ... for messages.
absl::string_view AddressClassDescription(AddressClass c);

// The fetch decision: public addresses only, plus loopback when
// `allow_loopback` (the test-only setting).
bool AddressAllowed(AddressClass c, bool allow_loopback);

// True when the environment has VLM_TEST_ALLOW_LOOPBACK_IMAGES=1 (test-only).
bool LoopbackImagesAllowedForTesting();

// An http(s) URL split for fetching.
struct ImageUrl {
  std::string scheme;  // "http" or "https"
  std::string host;    // lower case; an IPv6 literal without brackets
  int port = 0;        // explicit or the scheme's default
  std::string target;  // path and query, starting with '/'; the fragment dropped

  std::string Origin() const;  // "https://host:port" (IPv6 in brackets)
  std::string ToString() const { return Origin() + target; }
};

// Errors: InvalidArgument for a malformed URL, PermissionDenied for a scheme
// other than http/https.
absl::StatusOr<ImageUrl> ParseImageUrl(absl::string_view url);

// A redirect's Location against the URL that answered it (absolute, "//host",
// "/path", "?query" or a relative path), as an absolute URL to ParseImageUrl.
absl::StatusOr<std::string> ResolveRedirect(const ImageUrl& base, absl::string_view location);

// Resolves a host name to addresses by `deadline`.
using HostResolver =
    std::function<absl::StatusOr<std::vector<IpAddress>>(const std::string& host, absl::Time deadline)>;

// The system resolver (getaddrinfo on a separate thread, so a slow DNS server
// cannot hold the request past `deadline`).
absl::StatusOr<std::vector<IpAddress>> SystemResolve(const std::string& host, absl::Time deadline);

struct RemoteImageOptions {
  int64_t max_bytes = 20 << 20;             // per image
  absl::Duration timeout = absl::Seconds(10);  // for all images of a request together
  int max_redirects = 5;
  int max_parallel = 4;                     // fetches of one request at once
  int max_images = 8;  // images per request (inline ones count): more are refused before fetching
  bool allow_loopback = LoopbackImagesAllowedForTesting();  // test-only, see above
  std::string ca_file;                      // CAs trusted for https (empty: the system's)
  HostResolver resolve;                     // empty: SystemResolve
};

// Fetches one URL by `deadline` (following redirects); the image bytes, or an
// error whose message says what happened: PermissionDenied (refused scheme or
// address), InvalidArgument (bad URL, not an image, too large, HTTP status),
// DeadlineExceeded, Unavailable (cannot resolve or connect), Aborted (the
// connection or TLS failed after connecting).
absl::StatusOr<std::string> FetchRemoteImage(const std::string& url,
                                             const RemoteImageOptions& options,
                                             absl::Time deadline);

// Fetches every parsed->remote_images entry in parallel into its
// request.messages(m).content(p).image().data. Returns the first failure as a
// 400 ApiError (param: the image's URL field; code "image_url_not_allowed" for
// a refused scheme or address, else "image_fetch_failed"), or nullopt. A
// request with more than max_images images is refused without any fetch.
std::optional<ApiError> FetchRemoteImages(const RemoteImageOptions& options,
                                          OpenAiChatRequest* parsed);

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_REMOTE_IMAGE_H_
