// Test certificates made at test time with the `openssl` command line: CAs and
// leaf certificates (EC P-256, one day, serverAuth + clientAuth, the given
// subjectAltName) in one directory, as NAME.crt / NAME.key.
#ifndef VLM_TESTS_INTEGRATION_PKI_H_
#define VLM_TESTS_INTEGRATION_PKI_H_

#include <cstdlib>
#include <fstream>
#include <string>

namespace vlm::testing {

class Pki {
 public:
  explicit Pki(std::string dir) : dir_(std::move(dir)) {
    Run("mkdir -p '" + dir_ + "'");
  }

  // A self-signed CA `name`.
  bool MakeCa(const std::string& name) {
    return Run("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
               " -keyout '" + key(name) + "' -out '" + cert(name) + "' -subj '/CN=" + name +
               "' -days 1");
  }

  // A leaf `name` with common name `cn` and subjectAltName `san`
  // (e.g. "DNS:vlm-backend,IP:127.0.0.1"), signed by CA `ca`.
  bool MakeLeaf(const std::string& name, const std::string& cn, const std::string& san,
                const std::string& ca) {
    const std::string ext = dir_ + "/" + name + ".ext";
    std::ofstream(ext) << "subjectAltName=" << san
                       << "\nextendedKeyUsage=serverAuth,clientAuth\n"
                          "basicConstraints=CA:FALSE\n";
    const std::string csr = dir_ + "/" + name + ".csr";
    return Run("openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
               " -keyout '" + key(name) + "' -out '" + csr + "' -subj '/CN=" + cn + "'") &&
           Run("openssl x509 -req -in '" + csr + "' -CA '" + cert(ca) + "' -CAkey '" + key(ca) +
               "' -CAcreateserial -days 1 -extfile '" + ext + "' -out '" + cert(name) + "'");
  }

  std::string cert(const std::string& name) const { return dir_ + "/" + name + ".crt"; }
  std::string key(const std::string& name) const { return dir_ + "/" + name + ".key"; }
  const std::string& dir() const { return dir_; }

  // Runs a shell command quietly; true on exit status 0.
  static bool Run(const std::string& command) {
    return std::system((command + " >/dev/null 2>&1").c_str()) == 0;
  }

 private:
  std::string dir_;
};

}  // namespace vlm::testing

#endif  // VLM_TESTS_INTEGRATION_PKI_H_
