#include "common/tls.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace vlm {
namespace {

using grpc::experimental::FileWatcherCertificateProvider;

absl::StatusOr<std::string> ReadPemFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read ", what, " ", path));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is empty"));
  return text;
}

std::string OpenSslError() {
  const unsigned long code = ERR_get_error();  // NOLINT(runtime/int): OpenSSL's type
  ERR_clear_error();
  if (code == 0) return "no PEM block found";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;

// Every certificate of a PEM file (at least one).
absl::StatusOr<std::vector<X509Ptr>> ParseCertificates(const std::string& path, const char* what) {
  absl::StatusOr<std::string> text = ReadPemFile(path, what);
  if (!text.ok()) return text.status();
  std::unique_ptr<BIO, BioFree> bio(BIO_new_mem_buf(text->data(), static_cast<int>(text->size())));
  std::vector<X509Ptr> certs;
  ERR_clear_error();
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) certs.emplace_back(x);
  ERR_clear_error();  // the end of the file reads as an error
  if (certs.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, " holds no PEM certificate"));
  }
  return certs;
}

absl::Status CheckKeyPair(const std::string& cert_path, const std::string& key_path) {
  absl::StatusOr<std::vector<X509Ptr>> certs = ParseCertificates(cert_path, "certificate");
  if (!certs.ok()) return certs.status();
  absl::StatusOr<std::string> key_text = ReadPemFile(key_path, "private key");
  if (!key_text.ok()) return key_text.status();
  std::unique_ptr<BIO, BioFree> bio(
      BIO_new_mem_buf(key_text->data(), static_cast<int>(key_text->size())));
  ERR_clear_error();
  std::unique_ptr<EVP_PKEY, KeyFree> key(
      PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("private key ", key_path,
                                                   " is not an unencrypted PEM key: ",
                                                   OpenSslError()));
  }
  if (X509_check_private_key(certs->front().get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("private key ", key_path,
                                                   " does not belong to the certificate ",
                                                   cert_path));
  }
  return absl::OkStatus();
}

unsigned int RefreshSeconds(absl::Duration refresh) {
  return static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(refresh)));
}

absl::Status CheckRefresh(absl::Duration refresh) {
  if (refresh < absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat("the TLS file refresh interval is ",
                                                   absl::FormatDuration(refresh),
                                                   "; must be at least 1 s"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsServerFiles& files) {
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  if (files.cert.empty() || files.key.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs both --tls_cert and --tls_key (--tls_client_ca alone cannot serve TLS)");
  }
  if (absl::Status s = CheckRefresh(files.refresh); !s.ok()) return s;
  if (absl::Status s = CheckKeyPair(files.cert, files.key); !s.ok()) return s;
  if (!files.client_ca.empty()) {
    absl::StatusOr<std::vector<X509Ptr>> ca = ParseCertificates(files.client_ca, "client CA");
    if (!ca.ok()) return ca.status();
  }
  auto provider = std::make_shared<FileWatcherCertificateProvider>(
      files.key, files.cert, files.client_ca, RefreshSeconds(files.refresh));
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (files.client_ca.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsChannelFiles& files) {
  if (!files.enabled()) return grpc::InsecureChannelCredentials();
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError(
        "a client certificate needs both its certificate and its key file");
  }
  if (absl::Status s = CheckRefresh(files.refresh); !s.ok()) return s;
  if (!files.cert.empty()) {
    if (absl::Status s = CheckKeyPair(files.cert, files.key); !s.ok()) return s;
  }
  if (!files.ca.empty()) {
    absl::StatusOr<std::vector<X509Ptr>> ca = ParseCertificates(files.ca, "CA");
    if (!ca.ok()) return ca.status();
  }
  auto provider = std::make_shared<FileWatcherCertificateProvider>(
      files.key, files.cert, files.ca, RefreshSeconds(files.refresh));
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider);
  if (!files.ca.empty()) options.watch_root_certs();
  if (!files.cert.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::experimental::TlsCredentials(options);
  if (credentials == nullptr) return absl::InternalError("gRPC refused the TLS channel options");
  return credentials;
}

void ApplyTlsChannelArgs(const TlsChannelFiles& files, grpc::ChannelArguments* args) {
  if (files.enabled() && !files.server_name.empty()) {
    args->SetSslTargetNameOverride(files.server_name);
  }
}

std::string DescribeTls(const TlsServerFiles& files) {
  if (!files.enabled()) return "plaintext";
  if (files.client_ca.empty()) return absl::StrCat("TLS (cert ", files.cert, ")");
  return absl::StrCat("mTLS (cert ", files.cert, ", client CA ", files.client_ca, ")");
}

std::string DescribeTls(const TlsChannelFiles& files) {
  if (!files.enabled()) return "plaintext";
  std::vector<std::string> parts;
  parts.push_back(files.ca.empty() ? "system roots" : absl::StrCat("CA ", files.ca));
  if (!files.cert.empty()) parts.push_back(absl::StrCat("client cert ", files.cert));
  if (!files.server_name.empty()) parts.push_back(absl::StrCat("server name ", files.server_name));
  return absl::StrCat(files.cert.empty() ? "TLS (" : "mTLS (", absl::StrJoin(parts, ", "), ")");
}

}  // namespace vlm
