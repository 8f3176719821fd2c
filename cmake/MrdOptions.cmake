# Project-wide compile options: warnings and sanitizers, applied to our own
# targets through mrd_options (generated proto code gets no -W flags).
add_library(mrd_options INTERFACE)
target_compile_options(mrd_options INTERFACE
  -Wall -Wextra -Wshadow -Wnon-virtual-dtor -Wold-style-cast -Woverloaded-virtual
  -Wimplicit-fallthrough -fno-exceptions)
if(MRD_WERROR)
  target_compile_options(mrd_options INTERFACE -Werror)
endif()

if(MRD_SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
elseif(MRD_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
elseif(NOT MRD_SANITIZE STREQUAL "")
  message(FATAL_ERROR "MRD_SANITIZE must be '', 'address' or 'thread'")
endif()
