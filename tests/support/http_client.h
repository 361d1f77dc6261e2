// A small blocking HTTP/1.1 client for tests: one request per connection
// (Connection: close), every read bounded by a deadline. Deliberately not
// Beast, so the tests check the server against an independent parser.
#pragma once

#include <chrono>
#include <map>
#include <string>

namespace sg::test {

struct Response {
  int status = 0;  // 0: no response (connection failed or closed early)
  std::map<std::string, std::string> headers;  // lowercase names
  std::string body;
  std::string error;  // transport error, when status == 0
  std::string header(const std::string& n) const {
    auto it = headers.find(n);
    return it == headers.end() ? "" : it->second;
  }
};

class HttpClient {
 public:
  HttpClient(std::string host, int port) : host_(std::move(host)), port_(port) {}
  Response request(const std::string& method, const std::string& target, const std::string& body = "",
                   const std::map<std::string, std::string>& headers = {},
                   std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // Sends raw bytes and reads whatever comes back until EOF or timeout.
  Response raw(const std::string& bytes, std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // Opens a connection, sends bytes, then waits for the server to close it.
  // Returns the milliseconds until EOF, or -1 if still open at the timeout.
  long long wait_for_close(const std::string& bytes, std::chrono::milliseconds timeout);

 private:
  std::string host_;
  int port_;
};

Response parse_response(const std::string& raw);

}  // namespace sg::test
