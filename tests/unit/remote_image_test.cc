// The remote-image fetcher of the gateway's HTTP front end: the address
// decision for every class (pure, no connection), URL parsing and redirect
// resolution, then fetches from an image server on 127.0.0.1 only: refusal
// before any connection, redirects re-checked per hop, one resolution per hop
// (no DNS rebinding), size/time/status/type limits, and a request's images in
// parallel, bounded, in order, with the first failure naming its image.
//
// Names ending in .test are answered by a resolver given to the fetcher, so
// no DNS query leaves the machine; a refused address is never connected to,
// and where a broken check would connect, the first address is 127.0.0.1.
#include "services/gateway/remote_image.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "tests/integration/pki.h"

namespace vlm::gateway {
namespace {

using json = nlohmann::json;

IpAddress Ip(const std::string& text) {
  std::optional<IpAddress> ip = IpAddress::Parse(text);
  EXPECT_TRUE(ip.has_value()) << text;
  return ip.value_or(IpAddress());
}

AddressClass Classify(const std::string& text) { return ClassifyAddress(Ip(text)); }

// ---- the address decision ------------------------------------------------------------

TEST(AddressClassTest, EveryIpv4RangeHasItsClass) {
  const std::vector<std::pair<std::string, AddressClass>> cases = {
      {"127.0.0.1", AddressClass::kLoopback},
      {"127.255.255.254", AddressClass::kLoopback},
      {"10.0.0.1", AddressClass::kPrivate},
      {"10.255.255.255", AddressClass::kPrivate},
      {"172.16.0.1", AddressClass::kPrivate},
      {"172.31.255.255", AddressClass::kPrivate},
      {"192.168.1.1", AddressClass::kPrivate},
      {"169.254.169.254", AddressClass::kLinkLocal},  // cloud metadata
      {"169.254.0.1", AddressClass::kLinkLocal},
      {"0.0.0.0", AddressClass::kUnspecified},
      {"0.1.2.3", AddressClass::kUnspecified},
      {"224.0.0.1", AddressClass::kMulticast},
      {"239.255.255.250", AddressClass::kMulticast},
      {"255.255.255.255", AddressClass::kBroadcast},
      {"100.64.0.1", AddressClass::kSharedCgnat},
      {"100.127.255.255", AddressClass::kSharedCgnat},
      {"192.0.2.10", AddressClass::kDocumentation},
      {"198.51.100.7", AddressClass::kDocumentation},
      {"203.0.113.9", AddressClass::kDocumentation},
      {"198.18.0.1", AddressClass::kBenchmarking},
      {"198.19.255.255", AddressClass::kBenchmarking},
      {"192.0.0.170", AddressClass::kReserved},
      {"192.88.99.1", AddressClass::kReserved},
      {"240.0.0.1", AddressClass::kReserved},
      {"255.255.255.254", AddressClass::kReserved},
  };
  for (const auto& [text, expected] : cases) {
    EXPECT_EQ(Classify(text), expected) << text;
  }
}

TEST(AddressClassTest, Ipv4NeighboursOfEachRangeArePublic) {
  for (const std::string text :
       {"8.8.8.8", "1.1.1.1", "9.255.255.255", "11.0.0.0", "100.63.255.255", "100.128.0.0",
        "126.255.255.255", "128.0.0.0", "169.253.255.255", "169.255.0.0", "172.15.255.255",
        "172.32.0.0", "192.0.1.255", "192.0.3.0", "192.167.255.255", "192.169.0.0",
        "198.17.255.255", "198.20.0.0", "223.255.255.255"}) {
    EXPECT_EQ(Classify(text), AddressClass::kPublic) << text;
  }
}

TEST(AddressClassTest, EveryIpv6RangeHasItsClass) {
  const std::vector<std::pair<std::string, AddressClass>> cases = {
      {"::1", AddressClass::kLoopback},
      {"::", AddressClass::kUnspecified},
      {"fc00::1", AddressClass::kPrivate},
      {"fd12:3456:789a::1", AddressClass::kPrivate},
      {"fec0::1", AddressClass::kPrivate},
      {"fe80::1", AddressClass::kLinkLocal},
      {"febf:ffff::1", AddressClass::kLinkLocal},
      {"ff02::1", AddressClass::kMulticast},
      {"ff05::1:3", AddressClass::kMulticast},
      {"2001:db8::1", AddressClass::kDocumentation},
      {"3fff::1", AddressClass::kDocumentation},
      {"2001:2::1", AddressClass::kBenchmarking},
      {"2001::1", AddressClass::kReserved},          // Teredo
      {"2001:10::1", AddressClass::kReserved},       // ORCHID
      {"::7f00:1", AddressClass::kReserved},         // IPv4-compatible (deprecated)
      {"100::1", AddressClass::kReserved},           // discard-only
      {"64:ff9b:1::1", AddressClass::kReserved},     // local-use NAT64
      {"5f00::1", AddressClass::kReserved},          // outside 2000::/3
      {"4000::1", AddressClass::kReserved},
      {"1234::1", AddressClass::kReserved},
  };
  for (const auto& [text, expected] : cases) {
    EXPECT_EQ(Classify(text), expected) << text;
  }
  for (const std::string text : {"2606:4700:4700::1111", "2001:4860:4860::8888", "2a00:1450::1",
                                 "2001:200::1", "3ffe::1"}) {
    EXPECT_EQ(Classify(text), AddressClass::kPublic) << text;
  }
}

// IPv6 forms that carry an IPv4 address are judged by that address.
TEST(AddressClassTest, Ipv4InsideIpv6IsJudgedByTheIpv4Address) {
  const std::vector<std::pair<std::string, AddressClass>> cases = {
      {"::ffff:127.0.0.1", AddressClass::kLoopback},
      {"::ffff:7f00:1", AddressClass::kLoopback},
      {"::ffff:10.1.2.3", AddressClass::kPrivate},
      {"::ffff:172.16.0.1", AddressClass::kPrivate},
      {"::ffff:192.168.0.1", AddressClass::kPrivate},
      {"::ffff:169.254.169.254", AddressClass::kLinkLocal},
      {"::ffff:0.0.0.0", AddressClass::kUnspecified},
      {"::ffff:224.0.0.1", AddressClass::kMulticast},
      {"::ffff:255.255.255.255", AddressClass::kBroadcast},
      {"::ffff:100.64.0.1", AddressClass::kSharedCgnat},
      {"::ffff:8.8.8.8", AddressClass::kPublic},
      {"64:ff9b::127.0.0.1", AddressClass::kLoopback},  // NAT64
      {"64:ff9b::a9fe:a9fe", AddressClass::kLinkLocal},
      {"64:ff9b::8.8.8.8", AddressClass::kPublic},
      {"2002:7f00:1::", AddressClass::kLoopback},  // 6to4
      {"2002:a9fe:a9fe::1", AddressClass::kLinkLocal},
      {"2002:c0a8:101::1", AddressClass::kPrivate},
      {"2002:808:808::1", AddressClass::kPublic},
  };
  for (const auto& [text, expected] : cases) {
    EXPECT_EQ(Classify(text), expected) << text;
  }
}

TEST(AddressClassTest, OnlyPublicIsAllowedAndTheTestSettingAddsOnlyLoopback) {
  for (int c = static_cast<int>(AddressClass::kPublic);
       c <= static_cast<int>(AddressClass::kReserved); ++c) {
    const auto cls = static_cast<AddressClass>(c);
    SCOPED_TRACE(AddressClassDescription(cls));
    EXPECT_EQ(AddressAllowed(cls, false), cls == AddressClass::kPublic);
    EXPECT_EQ(AddressAllowed(cls, true),
              cls == AddressClass::kPublic || cls == AddressClass::kLoopback);
  }
}

TEST(IpAddressTest, ParsesOnlyCanonicalLiterals) {
  EXPECT_EQ(Ip("10.0.0.1").ToString(), "10.0.0.1");
  EXPECT_EQ(Ip("::FFFF:7F00:1").ToString(), "::ffff:127.0.0.1");
  EXPECT_TRUE(Ip("::1").v6);
  // Shorthand and non-decimal IPv4 forms are host names to the resolver (which
  // turns them into the address that is then checked), not literals here.
  for (const std::string text : {"127.1", "0x7f.0.0.1", "2130706433", "fe80::1%eth0", "", "[::1]"}) {
    EXPECT_FALSE(IpAddress::Parse(text).has_value()) << text;
  }
}

// ---- URLs ----------------------------------------------------------------------------

TEST(ImageUrlTest, SplitsHttpAndHttpsUrls) {
  absl::StatusOr<ImageUrl> u = ParseImageUrl("HTTPS://Images.Example.COM/a/b.png?x=1#frag");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->scheme, "https");
  EXPECT_EQ(u->host, "images.example.com");
  EXPECT_EQ(u->port, 443);
  EXPECT_EQ(u->target, "/a/b.png?x=1");
  u = ParseImageUrl("http://[::FFFF:127.0.0.1]:8080");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->host, "::ffff:127.0.0.1");
  EXPECT_EQ(u->port, 8080);
  EXPECT_EQ(u->target, "/");
  EXPECT_EQ(u->Origin(), "http://[::ffff:127.0.0.1]:8080");
  u = ParseImageUrl("http://example.com?q");
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->target, "/?q");
}

TEST(ImageUrlTest, RefusesOtherSchemesAndMalformedUrls) {
  for (const std::string url : {"file:///etc/passwd", "ftp://example.com/a.png",
                                "gopher://127.0.0.1:6379/_INFO", "dict://x/", "data://x"}) {
    absl::StatusOr<ImageUrl> u = ParseImageUrl(url);
    EXPECT_TRUE(absl::IsPermissionDenied(u.status())) << url << " " << u.status();
  }
  for (const std::string url :
       {"http://user:pw@example.com/", "http://example.com@127.0.0.1/", "http://exa mple.com/",
        "http://example.com/a\r\nHost: x", "http://example.com\\@evil/", "http:///path",
        "http://:80/", "http://example.com:0/", "http://example.com:65536/",
        "http://example.com:8o/", "http://[fe80::1%25eth0]/", "http://[127.0.0.1]/",
        "http://ex%61mple.com/", "http://caf\xc3\xa9.com/", "example.com/a.png"}) {
    absl::StatusOr<ImageUrl> u = ParseImageUrl(url);
    EXPECT_TRUE(absl::IsInvalidArgument(u.status())) << url << " " << u.status();
  }
}

TEST(ImageUrlTest, RedirectsResolveAgainstTheUrlThatAnswered) {
  const ImageUrl base = *ParseImageUrl("http://a.test:81/dir/img.png?q=1");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"https://b.test/x.png", "https://b.test/x.png"},
      {"//c.test/y.png", "http://c.test/y.png"},
      {"/z.png", "http://a.test:81/z.png"},
      {"other.png", "http://a.test:81/dir/other.png"},
      {"?q=2", "http://a.test:81/dir/img.png?q=2"},
      {"file:///etc/passwd", "file:///etc/passwd"},  // refused by ParseImageUrl next
  };
  for (const auto& [location, expected] : cases) {
    absl::StatusOr<std::string> next = ResolveRedirect(base, location);
    ASSERT_TRUE(next.ok()) << location;
    EXPECT_EQ(*next, expected) << location;
  }
  EXPECT_FALSE(ResolveRedirect(base, "").ok());
}

// ---- fetching from a loopback server -------------------------------------------------

std::string FakePng(int seed, size_t size = 64) {
  std::string bytes = "\x89PNG\r\n\x1a\n";
  while (bytes.size() < size) bytes.push_back(static_cast<char>('a' + (seed + bytes.size()) % 26));
  return bytes;
}

// An image server on 127.0.0.1 with a request count per path.
class ImageServer {
 public:
  ImageServer() {
    // Counted before the handler runs, so a count is complete once the client has an answer.
    server_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response&) {
      absl::MutexLock lock(&mu_);
      ++hits_[req.path];
      last_host_ = req.get_header_value("Host");
      return httplib::Server::HandlerResponse::Unhandled;
    });
  }
  ~ImageServer() {
    Release();
    server_.stop();
    if (thread_.joinable()) thread_.join();
  }
  httplib::Server& server() { return server_; }
  void Start() {
    port_ = server_.bind_to_any_port("127.0.0.1");
    ASSERT_GT(port_, 0);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    for (int i = 0; i < 5000 && !server_.is_running(); ++i) absl::SleepFor(absl::Milliseconds(1));
  }
  int port() const { return port_; }
  std::string Url(const std::string& path, const std::string& host = "127.0.0.1") const {
    return absl::StrCat("http://", host, ":", port_, path);
  }
  int Hits(const std::string& path) {
    absl::MutexLock lock(&mu_);
    return hits_[path];
  }
  int TotalHits() {
    absl::MutexLock lock(&mu_);
    int n = 0;
    for (const auto& [path, count] : hits_) n += count;
    return n;
  }
  std::string LastHost() {
    absl::MutexLock lock(&mu_);
    return last_host_;
  }
  // Handlers that hang wait for this (so the server stops at once).
  void WaitReleased(absl::Duration at_most) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&released_), at_most);
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    released_ = true;
  }

 private:
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  absl::Mutex mu_;
  std::map<std::string, int> hits_ ABSL_GUARDED_BY(mu_);
  std::string last_host_ ABSL_GUARDED_BY(mu_);
  bool released_ ABSL_GUARDED_BY(mu_) = false;
};

class RemoteImageFetchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto& s = images_.server();
    s.Get("/cat.png", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(FakePng(1), "image/png");
    });
    s.Get(R"(/img/(\d+)\.png)", [](const httplib::Request& req, httplib::Response& res) {
      res.set_content(FakePng(std::stoi(req.matches[1]), 100 + std::stoi(req.matches[1])),
                      "image/png");
    });
    s.Get("/note.txt", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("just text", "text/plain");
    });
    s.Get("/big.png", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(FakePng(2, 5000), "image/png");
    });
    // No Content-Length: the limit must hold while the body streams.
    s.Get("/big-chunked.png", [](const httplib::Request&, httplib::Response& res) {
      res.set_chunked_content_provider("image/png", [](size_t offset, httplib::DataSink& sink) {
        const std::string part = FakePng(3, 1000);
        sink.write(part.data(), part.size());
        if (offset > 100000) sink.done();
        return true;
      });
    });
    s.Get("/hang.png", [this](const httplib::Request&, httplib::Response& res) {
      images_.WaitReleased(absl::Seconds(20));
      res.set_content(FakePng(4), "image/png");
    });
    auto redirect = [](std::string location) {
      return [location](const httplib::Request&, httplib::Response& res) {
        res.status = 302;
        res.set_header("Location", location);
      };
    };
    s.Get("/to-relative", redirect("img/7.png"));
    s.Get("/to-absolute-path", redirect("/to-relative"));
    s.Get("/to-unspecified", [this](const httplib::Request&, httplib::Response& res) {
      res.status = 301;
      res.set_header("Location", images_.Url("/cat.png", "0.0.0.0"));
    });
    s.Get("/to-metadata-name", [this](const httplib::Request&, httplib::Response& res) {
      res.status = 307;
      res.set_header("Location", images_.Url("/cat.png", "metadata.test"));
    });
    s.Get("/to-file", redirect("file:///etc/passwd"));
    s.Get("/loop", redirect("/loop"));
    s.Get("/no-location", [](const httplib::Request&, httplib::Response& res) { res.status = 302; });
    images_.Start();
  }

  // allow_loopback as the tests need it, and a resolver for *.test names.
  RemoteImageOptions Options(bool allow_loopback) {
    RemoteImageOptions o;
    o.max_bytes = 2000;
    o.timeout = absl::Seconds(10);
    o.allow_loopback = allow_loopback;
    o.resolve = [this](const std::string& host,
                       absl::Time deadline) -> absl::StatusOr<std::vector<IpAddress>> {
      absl::MutexLock lock(&mu_);
      ++lookups_[host];
      if (host == "images.test" || host == "other.test") {
        return std::vector<IpAddress>{Ip("127.0.0.1")};
      }
      // A broken check would connect to the first, harmless, address.
      if (host == "mixed.test") return std::vector<IpAddress>{Ip("127.0.0.1"), Ip("10.0.0.7")};
      if (host == "metadata.test") {
        return std::vector<IpAddress>{Ip("127.0.0.1"), Ip("169.254.169.254")};
      }
      if (host == "mapped.test") return std::vector<IpAddress>{Ip("::ffff:127.0.0.1")};
      // A rebinding DNS server: an allowed address first, then an internal one.
      if (host == "rebind.test") {
        return std::vector<IpAddress>{Ip(lookups_[host] == 1 ? "127.0.0.1" : "10.0.0.1")};
      }
      if (absl::EndsWith(host, ".test")) {
        return absl::UnavailableError(absl::StrCat("cannot resolve ", host));
      }
      return SystemResolve(host, deadline);  // numeric forms and localhost: no DNS query
    };
    return o;
  }
  int Lookups(const std::string& host) {
    absl::MutexLock lock(&mu_);
    return lookups_[host];
  }

  absl::StatusOr<std::string> Fetch(const std::string& url, bool allow_loopback = true) {
    const RemoteImageOptions o = Options(allow_loopback);
    return FetchRemoteImage(url, o, absl::Now() + o.timeout);
  }

  ImageServer images_;
  absl::Mutex mu_;
  std::map<std::string, int> lookups_ ABSL_GUARDED_BY(mu_);
};

TEST_F(RemoteImageFetchTest, LoopbackIsRefusedBeforeAnyConnection) {
  for (const std::string host : {"127.0.0.1", "[::1]", "[::ffff:127.0.0.1]", "0.0.0.0", "localhost",
                                 "2130706433", "0x7f.1", "127.1", "images.test", "mapped.test"}) {
    absl::StatusOr<std::string> r = Fetch(images_.Url("/cat.png", host), false);
    EXPECT_TRUE(absl::IsPermissionDenied(r.status())) << host << " " << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "only public addresses are fetched"))
        << r.status();
  }
  EXPECT_EQ(images_.TotalHits(), 0);
  absl::StatusOr<std::string> r = Fetch(images_.Url("/cat.png", "images.test"), false);
  EXPECT_TRUE(absl::StrContains(r.status().message(),
                                "images.test resolves to 127.0.0.1, a loopback address"))
      << r.status();
  r = Fetch(images_.Url("/cat.png"), false);
  EXPECT_TRUE(absl::StrContains(r.status().message(), "127.0.0.1 is a loopback address"))
      << r.status();
}

TEST_F(RemoteImageFetchTest, TheTestSettingServesLoopbackAndNothingElse) {
  absl::StatusOr<std::string> r = Fetch(images_.Url("/cat.png"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, FakePng(1));
  r = Fetch(images_.Url("/cat.png", "[::ffff:127.0.0.1]"));
  EXPECT_TRUE(r.ok()) << r.status();
  // Every resolved address is checked, not only the one connected to.
  r = Fetch(images_.Url("/cat.png", "mixed.test"));
  EXPECT_TRUE(absl::IsPermissionDenied(r.status())) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(),
                                "mixed.test resolves to 10.0.0.7, a private address"))
      << r.status();
  EXPECT_EQ(images_.Hits("/cat.png"), 2);
}

TEST_F(RemoteImageFetchTest, OneResolutionPerHopAndTheConnectionGoesToTheCheckedAddress) {
  // The system resolver does not know rebind.test: the fetch works only if
  // the connection uses the address this resolver gave, once.
  absl::StatusOr<std::string> r = Fetch(images_.Url("/cat.png", "rebind.test"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Lookups("rebind.test"), 1);
  EXPECT_EQ(images_.LastHost(), absl::StrCat("rebind.test:", images_.port()));
}

TEST_F(RemoteImageFetchTest, RedirectsAreFollowedAndEachHopIsChecked) {
  absl::StatusOr<std::string> r = Fetch(images_.Url("/to-absolute-path"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, FakePng(7, 107));

  r = Fetch(images_.Url("/to-unspecified"));
  EXPECT_TRUE(absl::IsPermissionDenied(r.status())) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "redirected to http://0.0.0.0:"));
  EXPECT_TRUE(absl::StrContains(r.status().message(), "0.0.0.0 is an unspecified address"));

  r = Fetch(images_.Url("/to-metadata-name"));
  EXPECT_TRUE(absl::IsPermissionDenied(r.status())) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(),
                                "metadata.test resolves to 169.254.169.254, a link-local address"))
      << r.status();
  EXPECT_EQ(images_.Hits("/cat.png"), 0);

  r = Fetch(images_.Url("/to-file"));
  EXPECT_TRUE(absl::IsPermissionDenied(r.status())) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "scheme \"file\" is not fetched"));

  r = Fetch(images_.Url("/loop"));
  EXPECT_TRUE(absl::StrContains(r.status().message(), "more than 5 redirects")) << r.status();
  EXPECT_EQ(images_.Hits("/loop"), 6);

  r = Fetch(images_.Url("/no-location"));
  EXPECT_TRUE(absl::StrContains(r.status().message(), "answered HTTP 302 without a Location"));
}

TEST_F(RemoteImageFetchTest, SizeStatusTypeAndTimeLimits) {
  absl::StatusOr<std::string> r = Fetch(images_.Url("/big.png"));
  EXPECT_TRUE(absl::StrContains(r.status().message(), "larger than 2000 bytes")) << r.status();
  r = Fetch(images_.Url("/big-chunked.png"));
  EXPECT_TRUE(absl::StrContains(r.status().message(), "larger than 2000 bytes")) << r.status();
  r = Fetch(images_.Url("/missing.png"));
  EXPECT_TRUE(absl::StrContains(r.status().message(), "answered HTTP 404")) << r.status();
  r = Fetch(images_.Url("/note.txt"));
  EXPECT_TRUE(absl::StrContains(r.status().message(), "is not a JPEG, PNG or WebP image"));
  r = Fetch("http://unknown.test/cat.png");
  EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();

  RemoteImageOptions o = Options(true);
  o.timeout = absl::Milliseconds(300);
  r = FetchRemoteImage(images_.Url("/hang.png"), o, absl::Now() + o.timeout);
  EXPECT_TRUE(absl::IsDeadlineExceeded(r.status())) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "timed out")) << r.status();
}

// https: the connection goes to the checked address, the certificate is
// verified against the URL's host name.
TEST_F(RemoteImageFetchTest, HttpsVerifiesTheUrlsHostAtTheCheckedAddress) {
  testing::Pki pki(::testing::TempDir() + "remote_image_pki");
  ASSERT_TRUE(pki.MakeCa("ca"));
  ASSERT_TRUE(pki.MakeLeaf("images", "images.test", "DNS:images.test", "ca"));
  httplib::SSLServer tls(pki.cert("images").c_str(), pki.key("images").c_str());
  ASSERT_TRUE(tls.is_valid());
  tls.Get("/cat.png", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(FakePng(5), "image/png");
  });
  const int port = tls.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread serving([&] { tls.listen_after_bind(); });
  for (int i = 0; i < 5000 && !tls.is_running(); ++i) absl::SleepFor(absl::Milliseconds(1));

  RemoteImageOptions o = Options(true);
  o.ca_file = pki.cert("ca");
  const std::string url = absl::StrCat("https://images.test:", port, "/cat.png");
  absl::StatusOr<std::string> r = FetchRemoteImage(url, o, absl::Now() + o.timeout);
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) EXPECT_EQ(*r, FakePng(5));
  // The same server under a name its certificate does not hold.
  r = FetchRemoteImage(absl::StrCat("https://other.test:", port, "/cat.png"), o,
                       absl::Now() + o.timeout);
  EXPECT_TRUE(absl::StrContains(r.status().message(), "not trusted")) << r.status();
  // A CA the fetcher does not trust.
  r = FetchRemoteImage(url, Options(true), absl::Now() + o.timeout);
  EXPECT_TRUE(absl::StrContains(r.status().message(), "not trusted")) << r.status();
  tls.stop();
  serving.join();
}

// ---- a request's images --------------------------------------------------------------

// A chat request whose user message holds `urls` as image parts after a text part.
OpenAiChatRequest Request(const std::vector<std::string>& urls) {
  json content = json::array({{{"type", "text"}, {"text", "what?"}}});
  for (const std::string& url : urls) {
    content.push_back({{"type", "image_url"}, {"image_url", {{"url", url}}}});
  }
  json body = {{"model", "tiny"},
               {"messages", json::array({{{"role", "user"}, {"content", content}}})}};
  ParseOptions parse;
  parse.served_model_name = "tiny";
  parse.allow_remote_images = true;
  OpenAiChatRequest out;
  std::optional<ApiError> e = ParseChatCompletionRequest(body.dump(), parse, &out);
  EXPECT_FALSE(e.has_value()) << e->message;
  return out;
}

class RemoteImageBatchTest : public RemoteImageFetchTest {
 protected:
  void SetUp() override {
    // /wait/N.png: each request waits (up to 2 s) for `expected_` requests to be in flight.
    images_.server().Get(R"(/wait/(\d+)\.png)", [this](const httplib::Request& req,
                                                       httplib::Response& res) {
      {
        absl::MutexLock lock(&mu_);
        ++in_flight_;
        max_in_flight_ = std::max(max_in_flight_, in_flight_);
        // The peak, not the current count: the first to go on lowers the count.
        auto enough = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return max_in_flight_ >= expected_;
        };
        mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Milliseconds(wait_ms_));
      }
      const int n = std::stoi(req.matches[1]);
      res.set_content(FakePng(n, 100 + n), "image/png");
      absl::MutexLock lock(&mu_);
      --in_flight_;
    });
    RemoteImageFetchTest::SetUp();
  }
  void Expect(int in_flight, int wait_ms) {
    absl::MutexLock lock(&mu_);
    expected_ = in_flight;
    wait_ms_ = wait_ms;
  }
  int MaxInFlight() {
    absl::MutexLock lock(&mu_);
    return max_in_flight_;
  }

  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int max_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int expected_ ABSL_GUARDED_BY(mu_) = 1;
  int wait_ms_ ABSL_GUARDED_BY(mu_) = 0;
};

const std::string& ImageData(const OpenAiChatRequest& r, int part) {
  return r.request.messages(0).content(part).image().data();
}

TEST_F(RemoteImageBatchTest, ImagesArriveInParallelAndInOrder) {
  Expect(3, 5000);  // each of 3 fetches waits until all 3 are in flight
  OpenAiChatRequest r = Request({images_.Url("/wait/3.png"), images_.Url("/wait/1.png"),
                                 images_.Url("/wait/2.png")});
  std::optional<ApiError> e = FetchRemoteImages(Options(true), &r);
  ASSERT_FALSE(e.has_value()) << e->message;
  EXPECT_EQ(MaxInFlight(), 3);
  EXPECT_EQ(ImageData(r, 1), FakePng(3, 103));
  EXPECT_EQ(ImageData(r, 2), FakePng(1, 101));
  EXPECT_EQ(ImageData(r, 3), FakePng(2, 102));
}

TEST_F(RemoteImageBatchTest, ConcurrencyIsBounded) {
  Expect(3, 200);  // never reached with 2 at once: each waits 200 ms
  RemoteImageOptions o = Options(true);
  o.max_parallel = 2;
  OpenAiChatRequest r = Request({images_.Url("/wait/1.png"), images_.Url("/wait/2.png"),
                                 images_.Url("/wait/3.png"), images_.Url("/wait/4.png"),
                                 images_.Url("/wait/5.png")});
  std::optional<ApiError> e = FetchRemoteImages(o, &r);
  ASSERT_FALSE(e.has_value()) << e->message;
  EXPECT_EQ(MaxInFlight(), 2);
  for (int i = 1; i <= 5; ++i) EXPECT_EQ(ImageData(r, i), FakePng(i, 100 + i));
}

TEST_F(RemoteImageBatchTest, TheFailureNamesItsImageAmongAllImagesOfTheRequest) {
  // An inline image comes first: the failing remote one is image 3.
  json content = json::array(
      {{{"type", "image_url"},
        {"image_url", {{"url", "data:image/png;base64," + absl::Base64Escape(FakePng(9))}}}},
       {{"type", "image_url"}, {"image_url", {{"url", images_.Url("/cat.png")}}}},
       {{"type", "text"}, {"text", "and"}},
       {{"type", "image_url"}, {"image_url", {{"url", images_.Url("/missing.png")}}}}});
  json body = {{"model", "tiny"},
               {"messages", json::array({{{"role", "user"}, {"content", content}}})}};
  ParseOptions parse;
  parse.served_model_name = "tiny";
  parse.allow_remote_images = true;
  OpenAiChatRequest r;
  ASSERT_FALSE(ParseChatCompletionRequest(body.dump(), parse, &r).has_value());
  std::optional<ApiError> e = FetchRemoteImages(Options(true), &r);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code, grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(e->param, "messages[0].content[3].image_url.url");
  EXPECT_EQ(e->error_code, "image_fetch_failed");
  EXPECT_TRUE(absl::StartsWith(
      e->message, "image 3 (messages[0].content[3].image_url.url): http://127.0.0.1:"))
      << e->message;
  EXPECT_TRUE(absl::EndsWith(e->message, "/missing.png answered HTTP 404")) << e->message;

  OpenAiChatRequest refused = Request({images_.Url("/cat.png"), images_.Url("/cat.png", "mixed.test")});
  e = FetchRemoteImages(Options(true), &refused);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->error_code, "image_url_not_allowed");
  EXPECT_TRUE(absl::StartsWith(e->message, "image 2 (messages[0].content[2].image_url.url): "))
      << e->message;
}

TEST_F(RemoteImageBatchTest, TooManyImagesAreRefusedBeforeAnyFetch) {
  RemoteImageOptions o = Options(true);
  o.max_images = 2;
  OpenAiChatRequest r =
      Request({images_.Url("/cat.png"), images_.Url("/cat.png"), images_.Url("/cat.png")});
  std::optional<ApiError> e = FetchRemoteImages(o, &r);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->param, "messages");
  EXPECT_EQ(e->message, "request has 3 images; max_images_per_request is 2");
  EXPECT_EQ(images_.TotalHits(), 0);
}

TEST_F(RemoteImageBatchTest, AFailureStopsTheOtherFetches) {
  // A hanging image and a refused one: the refusal answers without waiting for the hang.
  OpenAiChatRequest r = Request({images_.Url("/hang.png"), images_.Url("/cat.png", "0.0.0.0")});
  const absl::Time start = absl::Now();
  std::optional<ApiError> e = FetchRemoteImages(Options(true), &r);
  ASSERT_TRUE(e.has_value());
  EXPECT_TRUE(absl::StartsWith(e->message, "image 2 ")) << e->message;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // the fetch of image 1 was cut, not awaited
}

TEST_F(RemoteImageBatchTest, AllImagesShareOneDeadline) {
  RemoteImageOptions o = Options(true);
  o.timeout = absl::Milliseconds(400);
  OpenAiChatRequest r = Request({images_.Url("/cat.png"), images_.Url("/hang.png")});
  const absl::Time start = absl::Now();
  std::optional<ApiError> e = FetchRemoteImages(o, &r);
  ASSERT_TRUE(e.has_value());
  EXPECT_TRUE(absl::StartsWith(e->message, "image 2 (messages[0].content[2].image_url.url): "))
      << e->message;
  EXPECT_TRUE(absl::StrContains(e->message, "timed out")) << e->message;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace vlm::gateway
