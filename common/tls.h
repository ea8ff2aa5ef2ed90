// TLS and mutual TLS for the gRPC servers and the channels between services.
//
// Certificates, keys and CA bundles are PEM files. They are checked once when
// the credentials are made (each file parses, the key belongs to the
// certificate), so a bad path or a mismatched pair fails the start with a
// message naming the file. After that gRPC's FileWatcherCertificateProvider
// re-reads the files every `refresh` and new handshakes use what it read:
// replacing the files (cert-manager rewriting a mounted Secret) rotates the
// certificate without a restart. Connections already open keep their session.
// A deleted or unreadable file is logged by gRPC and the last pair stays in
// use. gRPC 1.51 does not check a re-read pair: a key and certificate from
// different generations (files replaced one at a time and read in between)
// fail every handshake until the next re-read finds them matching, so replace
// both at once (a Kubernetes Secret volume swaps all its files atomically).
//
// Server side: `cert` + `key` turn TLS on; `client_ca` additionally requires
// every client to present a certificate signed by one of its CAs (mTLS).
// Channel side: TLS is on when any of `ca`, `cert`, `key` is given; `ca`
// verifies the server (empty: the system's root store), `cert` + `key` are
// the client certificate for mTLS, and `server_name` is the name the server's
// certificate must carry when the target is an address (a pod IP) rather than
// that name.
//
// Thread-safety: the functions are thread-safe; the credentials they return
// may be shared by any number of servers and channels.
#ifndef VLM_COMMON_TLS_H_
#define VLM_COMMON_TLS_H_

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace vlm {

struct TlsServerFiles {
  std::string cert;       // PEM certificate chain, leaf first
  std::string key;        // PEM private key of the leaf
  std::string client_ca;  // PEM CA bundle; non-empty => client certificates required
  absl::Duration refresh = absl::Seconds(60);  // how often the files are re-read

  bool enabled() const { return !cert.empty() || !key.empty() || !client_ca.empty(); }
};

struct TlsChannelFiles {
  std::string ca;           // PEM CA bundle that signed the server; "" => system roots
  std::string cert;         // PEM client certificate chain (mTLS), with `key`
  std::string key;          // PEM private key of `cert`
  std::string server_name;  // expected name in the server's certificate; "" => the target host
  absl::Duration refresh = absl::Seconds(60);

  bool enabled() const { return !ca.empty() || !cert.empty() || !key.empty(); }
};

// Insecure credentials when `files` is not enabled; TLS (or mTLS) otherwise.
// InvalidArgument: cert without key (or the reverse), client_ca without a
// certificate, a file that is missing or not PEM, a key that does not match.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsServerFiles& files);

// Insecure credentials when `files` is not enabled; TLS (or mTLS) otherwise.
// Same errors as above. Pair with ApplyTlsChannelArgs on the channel's arguments.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsChannelFiles& files);

// Sets the server-name override of `files.server_name` (if any) on `args`.
void ApplyTlsChannelArgs(const TlsChannelFiles& files, grpc::ChannelArguments* args);

// One line for logs, e.g. "mTLS (cert /tls/tls.crt, client CA /tls/ca.crt)" or "plaintext".
std::string DescribeTls(const TlsServerFiles& files);
std::string DescribeTls(const TlsChannelFiles& files);

}  // namespace vlm

#endif  // VLM_COMMON_TLS_H_
