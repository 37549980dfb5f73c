// Integration: TLS and mTLS on the real server. A throw-away CA, server certificate
// (localhost, 127.0.0.1) and client certificate are made with the openssl command at test
// time (skipped when openssl is not installed).
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace tls_test {
namespace {

bool HaveOpenssl() { return std::system("openssl version >/dev/null 2>&1") == 0; }

// Writes ca.pem, server.{pem,key}, client.{pem,key} into `dir` (ECDSA P-256, 1 day).
absl::Status MakeCerts(const std::string& dir) {
  const std::string script = absl::StrCat(
      "set -e; cd '", dir, "'\n",
      "K='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'\n",
      "openssl req -x509 $K -keyout ca.key -out ca.pem -days 1 -subj /CN=kvshade-test-ca 2>/dev/null\n",
      "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext\n",
      "openssl req $K -keyout server.key -out server.csr -subj /CN=localhost 2>/dev/null\n",
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 1 "
      "-extfile server.ext 2>/dev/null\n",
      "openssl req $K -keyout client.key -out client.csr -subj /CN=kvshade-test-client 2>/dev/null\n",
      "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 1 "
      "2>/dev/null\n");
  const std::string path = dir + "/make-certs.sh";
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return absl::InternalError("cannot write " + path);
  std::fputs(script.c_str(), f);
  std::fclose(f);
  if (std::system(("bash '" + path + "'").c_str()) != 0) return absl::InternalError("openssl failed");
  return absl::OkStatus();
}

TEST(Tls, TlsServerAcceptsTlsClientsOnly) {
  if (!HaveOpenssl()) GTEST_SKIP() << "openssl not installed";
  TempDir dir;
  KV_ASSERT_OK(MakeCerts(dir.path()));
  client::ClientOptions tls;
  tls.tls = true;
  tls.ca_file = dir.path() + "/ca.pem";
  tls.tls_server_name = "localhost";
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--tls-cert", dir.path() + "/server.pem", "--tls-key", dir.path() + "/server.key"}, tls));
  auto c = server.Connect(tls);
  KV_ASSERT_OK_AND_ASSIGN(stats, c->Stats());
  EXPECT_EQ(stats.backend(), "cpu");
  // A full round trip over TLS.
  const synthetic::Document doc(SmallDoc(256));
  v1::Profile exact;
  exact.set_kind(v1::PROFILE_KIND_EXACT);
  KV_ASSERT_OK_AND_ASSIGN(s, CreateAndIngest(*c, doc, exact, -1));
  KV_ASSERT_OK_AND_ASSIGN(info, c->GetSession(s.session_id()));
  EXPECT_EQ(info.tokens(), 256u);
  // Plaintext is refused at the transport.
  client::ClientOptions plain;
  plain.timeout = absl::Seconds(3);
  auto p = server.Connect(plain);
  EXPECT_EQ(p->Stats().status().code(), absl::StatusCode::kUnavailable);
  // A client that does not trust the server's CA is refused too.
  client::ClientOptions untrusted = tls;
  untrusted.ca_file = dir.path() + "/client.pem";  // not a CA of the server's certificate
  untrusted.timeout = absl::Seconds(3);
  auto u = server.Connect(untrusted);
  EXPECT_EQ(u->Stats().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// A client of the certificates MakeCerts wrote into `dir` (its CA, its client pair).
client::ClientOptions MutualTlsClient(const std::string& dir) {
  client::ClientOptions o;
  o.ca_file = dir + "/ca.pem";
  o.cert_file = dir + "/client.pem";
  o.key_file = dir + "/client.key";
  o.tls_server_name = "localhost";
  return o;
}

// A server that requires client certificates of the CA MakeCerts wrote into `dir`.
std::vector<std::string> MutualTlsServerArgs(const std::string& dir) {
  return {"--tls-cert", dir + "/server.pem", "--tls-key", dir + "/server.key",
          "--tls-client-ca", dir + "/ca.pem", "--require-client-cert"};
}

TEST(Tls, MutualTlsRequiresAClientCertificate) {
  if (!HaveOpenssl()) GTEST_SKIP() << "openssl not installed";
  TempDir dir;
  KV_ASSERT_OK(MakeCerts(dir.path()));
  const client::ClientOptions mtls = MutualTlsClient(dir.path());
  ServerProcess server;
  KV_ASSERT_OK(server.Start(MutualTlsServerArgs(dir.path()), mtls));
  auto c = server.Connect(mtls);
  KV_ASSERT_OK_AND_ASSIGN(list, c->ListSessions());
  EXPECT_EQ(list.sessions_size(), 0);
  client::ClientOptions no_cert = mtls;
  no_cert.cert_file.clear();
  no_cert.key_file.clear();
  no_cert.timeout = absl::Seconds(3);
  auto n = server.Connect(no_cert);
  EXPECT_EQ(n->ListSessions().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// A client certificate that is well formed but issued by another CA than --tls-client-ca
// is refused at the handshake; the same client with a certificate of the trusted CA works.
TEST(Tls, MutualTlsRefusesAClientCertificateFromAnotherCa) {
  if (!HaveOpenssl()) GTEST_SKIP() << "openssl not installed";
  TempDir dir, other;
  KV_ASSERT_OK(MakeCerts(dir.path()));
  KV_ASSERT_OK(MakeCerts(other.path()));  // its own CA, client certificate and key
  const client::ClientOptions mtls = MutualTlsClient(dir.path());
  ServerProcess server;
  KV_ASSERT_OK(server.Start(MutualTlsServerArgs(dir.path()), mtls));
  client::ClientOptions foreign = mtls;
  foreign.cert_file = other.path() + "/client.pem";
  foreign.key_file = other.path() + "/client.key";
  foreign.timeout = absl::Seconds(3);
  auto f = server.Connect(foreign);
  EXPECT_EQ(f->ListSessions().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(f->Stats().status().code(), absl::StatusCode::kUnavailable);
  auto c = server.Connect(mtls);
  KV_ASSERT_OK(c->ListSessions().status());
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace tls_test
}  // namespace kvshade::integration
